"""Start a node's other ranks as child processes, and stop the node when one of them dies.

A child is `python -m engine.distributed.rank_worker --rank R`: it reads the config from rank 0's store, and
exits when its stdin pipe hangs up (engine/transport/ipc.py `die_with_parent`), so children never outlive the
process that started them. That process watches them: a rank that exits while the engine runs ends it
at once with exit code 1 (the server then fails every request in flight); its collectives would
otherwise wait up to the group's timeout.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

log = logging.getLogger("engine")


def _death(rank: int, proc: subprocess.Popen[bytes], code: int) -> str:
    how = f"signal {-code}" if code < 0 else f"code {code}"
    return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with {how}"


def _fatal(why: str) -> NoReturn:
    log.error("%s; stopping this engine", why)
    os._exit(1)  # mid-collective, a normal exit could wait on the dead rank; children die with our pipes


class LocalRanks:
    """Ranks first..first+count-1 of this node, each a child watched by a thread."""

    def __init__(
        self, ranks: range, addr: str, port: int, timeout: float, on_death: Callable[[str], None] = _fatal
    ) -> None:
        self.closing = False
        self._on_death = on_death
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        for rank in ranks:
            cmd = [
                sys.executable,
                "-m",
                "engine.distributed.rank_worker",
                "--rank",
                str(rank),
                "--master-addr",
                addr,
                "--master-port",
                str(port),
                "--timeout",
                str(timeout),
            ]
            # stdin: a pipe only we write (never), so the child sees a hang-up when we are gone
            self.procs[rank] = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        for rank, proc in self.procs.items():
            threading.Thread(target=self._watch, args=(rank, proc), name=f"rank{rank}-watch", daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self.closing and code != 0:  # 0: it was told to stop, or its parent (we) is already gone
            self.kill()
            self._on_death(_death(rank, proc, code))

    def kill(self) -> None:
        """SIGKILL every child: a stopped (SIGSTOP) or wedged rank would never see its pipe hang up."""
        self.closing = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()

    def dead(self, wait: float = 0.5) -> list[str]:
        """Which children have exited, waiting up to `wait` s for one (a reset socket can beat the exit)."""
        deadline = time.monotonic() + wait
        while True:
            dead = [_death(r, p, p.returncode) for r, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.02)

    def stop(self, grace: float = 5.0) -> None:
        """Close their pipes (they exit at once), wait a little, then kill what is left."""
        self.closing = True
        for proc in self.procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs.values():
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
