"""`--api-server-count N`: N API-server processes accept on one listening socket, in front of the engine core(s).

The process the user starts becomes the launcher (`run_api_servers`); it serves no HTTP itself. It
1. binds and listens once, and hands the listening socket to every API process (inherited, `fd://` for
   Hypercorn). Not SO_REUSEPORT: with one socket the kernel keeps one accept queue that whichever process is
   free drains (SO_REUSEPORT hashes each connection to a fixed process, busy or not), `--port 0` means one
   port for all, no other program of the same user can bind into the group, and the address is bound
   exactly once, before any process starts;
2. makes one shared memory file (`server/shared_state.py`: admission counts and metrics, one slot per process);
3. makes one Unix socketpair per API process and engine core, and starts each engine core (one, or M with
   `--data-parallel-size M`) with its engine ends (`python -m engine --channels ...`, `engine/channels.py`);
   an engine's stdin is only the launcher's lifeline;
4. starts the N API processes (`python -m server.api_servers`), each with the listening socket, its own
   channel end to every engine and the shared file, in a session of their own (a terminal's Ctrl-C or a
   group SIGTERM reaches only the launcher, which forwards it once). With M engines each API process puts
   its M channels in an `EnginePool` (server/pipeline/engine_pool.py) and chooses per request as a single
   server does (the engines report the same stats to every process);
5. waits. SIGTERM / SIGINT are forwarded to the API processes (each drains or stops as a single server
   does); when they have all exited, the engines' lifelines are closed and the engines stop. If an engine
   dies, every API process sees its channel close, fails its requests at once and exits 1; the launcher
   exits 1. If an API process fails, the others are stopped and the launcher exits 1.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from server.config import ServerConfig

log = logging.getLogger("spindle.server")
_ENV = "SPINDLE_API_SERVER_PROCESS"  # the API process's part: JSON (index, count, fds, the pickled config)


@dataclass(frozen=True)
class WorkerContext:
    """What an API process started by the launcher gets: its place, its fds."""

    index: int
    count: int
    listen_fd: int
    engine_fds: list[int]  # this process's channel to each engine core, in engine order
    engine_pids: list[int]
    shared_fd: int

    def region(self) -> Any:
        from server.shared_state import SharedRegion

        return SharedRegion(self.shared_fd, self.count, self.index)


current: WorkerContext | None = None  # set in an API process started by the launcher
_region: Any = None


def region() -> Any:
    """This process's view of the shared memory (one mapping per process)."""
    global _region
    if _region is None and current is not None:
        _region = current.region()
    return _region


def admission(config: ServerConfig) -> Any:
    from server.shared_state import SharedAdmission

    return SharedAdmission(region(), config.max_num_queued_reqs, config.max_num_queued_tokens)


def share_metrics(metrics: Any) -> None:
    from server.shared_state import share_metrics as share

    share(metrics, region())


def engine_routed(num_engines: int) -> Any:
    """Requests routed to each engine, summed over the API processes (server/shared_state.py)."""
    from server.shared_state import engine_routed as routed

    return routed(region(), num_engines)


def open_engine(config: ServerConfig, index: int = 0) -> Any:
    """This process's channel to engine core `index`."""
    from engine.channel_client import open_engine_channel

    assert current is not None
    return open_engine_channel(current.engine_fds[index], current.engine_pids[index],
                               ready_timeout=config.engine_ready_timeout,
                               heartbeat_timeout=config.engine_heartbeat_timeout,
                               step_timeout=config.engine_step_timeout)


def _listen(config: ServerConfig) -> socket.socket:
    """The one listening socket (as Hypercorn would make it)."""
    host = config.host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if config.socket_send_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_send_buffer)
    sock.bind((host, config.port))
    sock.listen(1024)
    return sock


def _exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


def run_api_servers(config: ServerConfig) -> int:
    """The launcher (module docstring). Returns the exit code: 0 after a clean stop, 1 on any failure."""
    from engine.client import engine_command
    from server.shared_state import SharedRegion

    n, m = config.api_server_count, config.data_parallel_size
    os.environ["SPINDLE_LOG_LEVEL"] = config.log_level
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config.resolved()  # builds the demo checkpoint once, here, not in N processes at once
        listener = _listen(cfg)
    except Exception as e:  # noqa: BLE001 - e.g. the port is taken
        log.error("server failed: %s", e)
        return 1
    shared_fd, _ = SharedRegion.create(n)
    # pairs[e][i]: engine e's channel to API process i (the engine keeps [0], the API process [1])
    pairs = [[socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n)] for _ in range(m)]
    engines: dict[int, subprocess.Popen[bytes]] = {}
    for channels in pairs:
        engine_fds = [a.fileno() for a, _ in channels]
        engine = subprocess.Popen([*engine_command(cfg.engine_config()), "--channels", ",".join(map(str, engine_fds))],
                                  stdin=subprocess.PIPE, pass_fds=engine_fds)
        engines[engine.pid] = engine
        for a, _ in channels:
            a.close()
    payload = base64.b64encode(pickle.dumps(cfg)).decode()
    apis: dict[int, subprocess.Popen[bytes]] = {}
    for i in range(n):
        ends = [channels[i][1] for channels in pairs]
        part = {"index": i, "count": n, "listen_fd": listener.fileno(), "engine_fds": [b.fileno() for b in ends],
                "engine_pids": list(engines), "shared_fd": shared_fd, "config": payload}
        proc = subprocess.Popen([sys.executable, "-m", "server.api_servers"], env={**os.environ, _ENV: json.dumps(part)},
                                pass_fds=(listener.fileno(), shared_fd, *(b.fileno() for b in ends)),
                                start_new_session=True)
        apis[proc.pid] = proc
        for b in ends:
            b.close()
    listener.close()
    os.close(shared_fd)
    log.info("%d API servers on %s:%d, %d engine core(s) (pid %s)", n, cfg.host, cfg.port, m,
             ", ".join(map(str, engines)))

    def forward(signum: int, _frame: Any) -> None:
        for p in apis.values():
            if p.returncode is None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = 0
    running = set(apis)
    while running:
        pid, status = os.waitpid(-1, 0)
        if pid in engines:
            engine = engines[pid]
            engine.returncode = _exit_code(status)
            log.error("engine core %d died (exit %d): the API servers fail their requests and stop", pid,
                      engine.returncode)
            code = 1  # the API processes see their channels close and exit 1 on their own
            _reap_within(apis, running, 10.0, engines)
            break
        if pid in apis:
            apis[pid].returncode = rc = _exit_code(status)
            running.discard(pid)
            if rc != 0 and code == 0:
                log.error("API server process %d exited with %d: stopping the others", pid, rc)
                code = 1
                forward(signal.SIGINT, None)
    # every API process is gone: close the lifelines, the engines exit (else SIGKILL)
    for engine in engines.values():
        assert engine.stdin is not None
        engine.stdin.close()
    deadline = time.monotonic() + 2.0
    for engine in engines.values():
        if engine.returncode is None:
            try:
                engine.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                engine.kill()
                engine.wait()
    return code


def _reap_within(apis: dict[int, subprocess.Popen[bytes]], running: set[int], timeout: float,
                 engines: dict[int, subprocess.Popen[bytes]]) -> None:
    """Wait up to `timeout` s for the API processes, then SIGKILL the rest; reaps them all (and records
    any engine that exits meanwhile)."""
    deadline = time.monotonic() + timeout
    while running and time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        if pid in apis:
            apis[pid].returncode = _exit_code(status)
            running.discard(pid)
        elif pid in engines:
            engines[pid].returncode = _exit_code(status)
    for pid in list(running):
        os.kill(pid, signal.SIGKILL)
        apis[pid].returncode = _exit_code(os.waitpid(pid, 0)[1])
        running.discard(pid)


def worker_main() -> int:
    """An API process started by the launcher: a single server's `run_server`, on the shared socket and channel."""
    global current
    part = json.loads(os.environ.pop(_ENV))
    config: ServerConfig = pickle.loads(base64.b64decode(part.pop("config")))
    current = WorkerContext(**part)
    # Engine request ids start with a per-process counter (input_processor.unique_prefix): interleave them
    # so that two processes never make the same id for one engine.
    import itertools

    from server.pipeline import input_processor

    input_processor._request_numbers = itertools.count(current.index, current.count)
    from server.cli import run_server

    # every line says which API process wrote it (run_server's own basicConfig is then a no-op)
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[api-server {current.index}]: %(message)s")
    return run_server(config)


if __name__ == "__main__":  # run as __main__: the app reads the context from the imported module, not this one
    from server.api_servers import worker_main as _worker_main

    sys.exit(_worker_main())
