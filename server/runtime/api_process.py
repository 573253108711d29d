"""`python -m server.runtime.api_process`: one API process of --api-server-count, started by the launcher.

It reads its WorkerContext and the launcher's config from its environment (server/worker_context.py) and
runs a single server's `run_server` with that context: on the shared socket, over its channels to the
launcher's engines, with the admission counts and metrics shared with the other API processes.
"""

from __future__ import annotations

import itertools
import os
import select
import signal
import sys
import threading

from server.request import input_processor
from server.runtime.http_server import run_server
from server.worker_context import from_environment


def main() -> int:
    worker, config = from_environment()
    if worker.launcher_fd is not None:
        _stop_with_launcher(worker.launcher_fd)
    # Engine request ids start with a per-process counter (input_processor.unique_prefix): interleave them
    # so that two processes never make the same id for one engine.
    input_processor._request_numbers = itertools.count(worker.index, worker.count)
    return run_server(config, worker=worker)  # every log line says which API process wrote it


def _stop_with_launcher(fd: int) -> None:
    """--models-dir: no engine hangs on the launcher's lifeline (API process 0 starts them), so a SIGKILLed launcher
    would leave the API processes running. Its pipe hanging up is a SIGTERM to this process: drain, then exit (and
    process 0's owner stops the engines). A thread, as engine/transport/ipc.py die_with_parent, for the same reasons."""

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, 0)  # no events asked: poll() still reports POLLHUP
        while not any(event & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, event in poller.poll()):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


if __name__ == "__main__":  # a spawned child (multiprocessing) re-imports this as __mp_main__: no second server
    sys.exit(main())
