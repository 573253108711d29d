"""`--api-server-count N`: N API-server processes accept on one listening socket, in front of the engine core(s).

The process the user starts becomes the launcher (`run_api_servers`); it serves no HTTP itself. It
1. binds and listens once, and hands the listening socket to every API process (inherited, `fd://` for
   Hypercorn). Not SO_REUSEPORT: with one socket the kernel keeps one accept queue that whichever process is
   free drains (SO_REUSEPORT hashes each connection to a fixed process, busy or not), `--port 0` means one
   port for all, no other program of the same user can bind into the group, and the address is bound
   exactly once, before any process starts;
2. makes one shared memory file (`server/shared_state.py`: admission counts and metrics, one slot per process)
   and one private directory for the stored /v1/responses (one SQLite file all API processes open,
   server/families/responses/store.py), removed when the launcher exits;
3. makes one Unix socketpair per API process and engine core, and starts each engine core (one, or M with
   `--data-parallel-size M`) with its engine ends (`python -m engine --channels ...`, `engine/transport/channels.py`);
   an engine's stdin is only the launcher's lifeline. With `--models-dir` it starts no engine: it makes one control
   socketpair per API process instead, whose other ends all go to API process 0, the owner of the loaded set, which
   starts each model's engine and hands every process its channel (server/fleet/owner.py);
4. starts the N API processes (`python -m server.runtime.api_process`), each with its WorkerContext
   (server/worker_context.py: the listening socket, its own channel end to every engine and the shared
   file), in a session of their own (a terminal's Ctrl-C or a group SIGTERM reaches only the launcher,
   which forwards it once). With M engines each API process puts its M channels in an `EnginePool`
   (server/engine_pool.py) and chooses per request as a single server does (the engines report
   the same stats to every process);
5. waits. SIGTERM / SIGINT are forwarded to the API processes (each drains or stops as a single server
   does); when they have all exited, the engines' lifelines are closed and the engines stop. If an engine
   dies, every API process sees its channel close, fails its requests at once and exits 1; the launcher
   exits 1. If an API process fails, the others are stopped and the launcher exits 1. With `--models-dir` the API
   processes watch a pipe only the launcher holds open instead (no engine hangs on its lifeline): a SIGKILLed
   launcher is a SIGTERM to each of them (server/runtime/api_process.py).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from types import FrameType

from engine.client.process_client import engine_command
from server.config import ServerConfig
from server.runtime.logs import setup_logging
from server.runtime.sockets import listen
from server.shared_state import SharedRegion
from server.worker_context import ENV, WorkerContext

log = logging.getLogger("spindle.server")
API_PROCESS_MODULE = "server.runtime.api_process"  # `python -m` this: one API process


def run_api_servers(config: ServerConfig) -> int:
    """The launcher (module docstring). Returns the exit code: 0 after a clean stop, 1 on any failure."""
    setup_logging(config.outputs.log_level)
    try:
        # builds the demo checkpoint once, here, not in N processes at once (--models-dir: no checkpoint of its own)
        cfg = config.resolved() if config.models.models_dir is None else config
        listener = listen(cfg)
    except Exception as e:  # noqa: BLE001 - e.g. the port is taken
        log.error("server failed: %s", e)
        return 1
    with tempfile.TemporaryDirectory(prefix="spindle-responses-") as responses_dir:  # mode 0700
        return _serve(cfg, listener, responses_dir)


def _serve(cfg: ServerConfig, listener: socket.socket, responses_dir: str) -> int:
    fleet = _start(cfg, listener, responses_dir)
    log.info(
        "%d API servers on %s:%d, %s",
        cfg.parallel.api_server_count,
        cfg.http.host,
        cfg.http.port,
        f"{len(fleet.engines)} engine core(s) (pid {', '.join(map(str, fleet.engines))})"
        if fleet.engines
        else f"the models of {cfg.models.models_dir}, loaded by API process 0",
    )
    code = fleet.wait()
    fleet.stop_engines()
    return code


def _start(cfg: ServerConfig, listener: socket.socket, responses_dir: str) -> _Fleet:
    """The engine cores and the API processes, each with its ends of the channels; the parent's copies closed."""
    n, m = cfg.parallel.api_server_count, cfg.parallel.data_parallel_size
    models = cfg.models.models_dir is not None
    m = 0 if models else m  # API process 0 starts each model's engine
    shared_fd, _ = SharedRegion.create(n)
    # pairs[e][i]: engine e's channel to API process i (the engine keeps [0], the API process [1])
    pairs = [[socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n)] for _ in range(m)]
    # --models-dir: controls[i]: API process i's control socket to the owner (process 0 keeps every [0], i its [1])
    controls = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n if models else 0)]
    # --models-dir: no engine holds the launcher's lifeline, so each API process watches this pipe's read end; the
    # write end stays open in the launcher until it exits
    lifeline = os.pipe() if models else None
    engines = {engine.pid: engine for engine in (_start_engine(cfg, [a for a, _ in channels]) for channels in pairs)}
    fleet = _Fleet(engines, {})
    # The API processes start with SIGINT / SIGTERM blocked (the mask survives exec) and unblock them once they
    # handle them (http_server.py watch_signals): a stop during their start-up waits for them instead of killing
    # one mid-import (which made the launcher exit 1). The launcher holds its own until it forwards them.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        # Handlers before the fork: a child then starts with the default action, not an inherited SIG_IGN (a
        # launcher started in the background by a script ignores SIGINT), which trio's main-thread check
        # re-sets, discarding the SIGINT held pending since exec: the API process never stopped.
        signal.signal(signal.SIGTERM, fleet.forward)
        signal.signal(signal.SIGINT, fleet.forward)
        for i in range(n):
            ends = [channels[i][1] for channels in pairs]
            context = WorkerContext(
                index=i,
                count=n,
                listen_fd=listener.fileno(),
                engine_fds=[b.fileno() for b in ends],
                engine_pids=list(engines),
                shared_fd=shared_fd,
                responses_dir=responses_dir,
                models_fd=controls[i][1].fileno() if models else None,
                models_owner_fds=[a.fileno() for a, _ in controls] if models and i == 0 else [],
                launcher_fd=lifeline[0] if lifeline is not None else None,
            )
            proc = _start_api_process(cfg, context)
            fleet.add_api(proc)
            for b in ends:
                b.close()
            if models:
                controls[i][1].close()
                if i == 0:
                    for a, _ in controls:
                        a.close()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    listener.close()
    os.close(shared_fd)
    if lifeline is not None:
        os.close(lifeline[0])
        fleet.lifeline = lifeline[1]
    return fleet


def _start_engine(cfg: ServerConfig, ends: list[socket.socket]) -> subprocess.Popen[bytes]:
    """One engine core serving `ends` (one channel per API process); its stdin is the launcher's lifeline."""
    fds = [a.fileno() for a in ends]
    engine = subprocess.Popen(
        [*engine_command(cfg.engine_config()), "--channels", ",".join(map(str, fds))],
        stdin=subprocess.PIPE,
        pass_fds=fds,
    )
    for a in ends:
        a.close()
    return engine


def _start_api_process(cfg: ServerConfig, context: WorkerContext) -> subprocess.Popen[bytes]:
    """One API process with its fds and its context in the environment, in a session of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", API_PROCESS_MODULE],
        env={**os.environ, ENV: context.encode(cfg)},
        pass_fds=(
            context.listen_fd,
            context.shared_fd,
            *context.engine_fds,
            *([context.models_fd] if context.models_fd is not None else []),
            *context.models_owner_fds,
            *([context.launcher_fd] if context.launcher_fd is not None else []),
        ),
        start_new_session=True,
    )


class _Fleet:
    """The launcher's children by pid: it forwards signals to the API processes, reaps, and stops the engines."""

    def __init__(self, engines: dict[int, subprocess.Popen[bytes]], apis: dict[int, subprocess.Popen[bytes]]) -> None:
        self.engines, self.apis = engines, apis
        self.running = set(apis)  # API processes not reaped yet
        self.lifeline: int | None = None  # --models-dir: the write end of the API processes' lifeline

    def add_api(self, proc: subprocess.Popen[bytes]) -> None:
        self.apis[proc.pid] = proc
        self.running.add(proc.pid)

    def forward(self, signum: int, _frame: FrameType | None = None) -> None:
        for p in self.apis.values():
            if p.returncode is None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    def wait(self) -> int:
        """Until every API process exited (or an engine died): 0 if they all exited 0, else 1."""
        code = 0
        while self.running:
            pid, status = os.waitpid(-1, 0)
            if pid in self.engines:
                engine = self.engines[pid]
                engine.returncode = os.waitstatus_to_exitcode(status)
                log.error(
                    "engine core %d died (exit %d): the API servers fail their requests and stop",
                    pid,
                    engine.returncode,
                )
                self._reap_within(10.0)  # the API processes see their channels close and exit 1 on their own
                return 1
            if pid in self.apis:
                self.apis[pid].returncode = rc = os.waitstatus_to_exitcode(status)
                self.running.discard(pid)
                if rc != 0 and code == 0:
                    log.error("API server process %d exited with %d: stopping the others", pid, rc)
                    code = 1
                    self.forward(signal.SIGINT)
        return code

    def _reap_within(self, timeout: float) -> None:
        """Wait up to `timeout` s for the API processes, then SIGKILL the rest; reaps them all (and records
        any engine that exits meanwhile)."""
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.05)
                continue
            if pid in self.apis:
                self.apis[pid].returncode = os.waitstatus_to_exitcode(status)
                self.running.discard(pid)
            elif pid in self.engines:
                self.engines[pid].returncode = os.waitstatus_to_exitcode(status)
        for pid in list(self.running):
            os.kill(pid, signal.SIGKILL)
            self.apis[pid].returncode = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            self.running.discard(pid)

    def stop_engines(self) -> None:
        """Every API process is gone: close the lifelines, the engines exit (else SIGKILL after 2 s)."""
        for engine in self.engines.values():
            assert engine.stdin is not None
            engine.stdin.close()
        deadline = time.monotonic() + 2.0
        for engine in self.engines.values():
            if engine.returncode is None:
                try:
                    engine.wait(max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    engine.kill()
                    engine.wait()
