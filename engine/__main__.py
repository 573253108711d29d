"""Engine core subprocess: `python -m engine --config JSON`. Frames on stdin / the original stdout."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import traceback

from engine.hugepages import reexec_for_model

if __name__ == "__main__":  # before torch loads: glibc reads its malloc tunables only at start
    reexec_for_model(sys.argv[1:])

from engine.config import EngineConfig, EngineEnv
from engine.core.loop import Links, Pipes, serve
from engine.cpu_threads import fit_cpu_threads
from engine.messages import LoadFailed, ToEngine
from engine.transport.channels import ChannelSet, wait_for_lifeline
from engine.transport.ipc import FrameReader, FrameWriter, die_with_parent

# The engine runs this much nicer than the API server that started it (relative: a server started under
# `nice` keeps the gap). The render workers use the same value (server/render/render_worker.py).
NICE_BELOW_SERVER = 10


def run_below_server() -> None:
    """Lower this thread's scheduling priority below the API server's, for every thread started after it.

    On a machine with few cores the engine's threads (the step, the LM head's helpers) otherwise hold the
    cores while the server's event loop, woken by a request or by a step's outputs, waits for one: /health
    and every stream stall for a scheduler slice (bench/README.md, "Responsiveness under load"). Nicer,
    the engine still gets every core the server does not want, so throughput stays. Linux keeps nice per
    thread and new threads inherit it, so this runs before any thread starts (the watchdog, torch's, the
    LM head's, the heartbeat).
    """
    try:
        os.nice(NICE_BELOW_SERVER)
    except OSError:  # raising nice needs no privilege; a sandbox that forbids it only costs responsiveness
        pass


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m engine")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument(
        "--channels",
        default="",
        help="socket fds, one per API server (engine/transport/channels.py); none: frames on stdin / stdout",
    )
    args = parser.parse_args()
    run_below_server()
    # EOF on stdin ends the step loop; this also covers a step that never returns. The grace lets an idle
    # loop end on its own first (tensor parallel: rank 0 tells the other ranks to stop), inside the 0.5 s
    # the server waits before SIGKILL (engine/client/process_client.py).
    die_with_parent(grace=0.3)
    # Ctrl-C and a process group's SIGTERM (systemd) go to the server, which drains, then closes our stdin
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # frames go to the original stdout; anything a library prints goes to stderr instead
    out_fd = os.dup(1)
    os.dup2(2, 1)
    links: Links
    if args.channels:  # several API servers: fd 0 is only the launcher's lifeline (die_with_parent)
        links = ChannelSet([int(fd) for fd in args.channels.split(",")])
    else:
        links = Pipes(FrameReader(0, ToEngine), FrameWriter(out_fd))
    logging.basicConfig(level=EngineEnv.read().log_level, format="%(asctime)s engine %(levelname)s %(message)s")
    try:
        config = EngineConfig(**json.loads(args.config))
    except Exception as e:  # noqa: BLE001 - any load failure is reported to the parent, then we exit
        links.broadcast(LoadFailed(f"{type(e).__name__}: {e}"))
        sys.exit(1)
    fit_cpu_threads(config.cpu_threads)  # before torch's thread pool starts (a tensor-parallel rank then runs one)
    try:
        serve(config, links)
    except (BrokenPipeError, KeyboardInterrupt):
        return
    except Exception as e:  # noqa: BLE001
        from engine.models.loader import ModelLoadError  # late: torch is loaded by now, this costs nothing

        if not isinstance(e, ModelLoadError):  # a load error's message says it all: no stack trace for it
            traceback.print_exc()
        links.broadcast(LoadFailed(f"{type(e).__name__}: {e}"))
        sys.exit(1)
    if args.channels:
        wait_for_lifeline()


if __name__ == "__main__":
    main()
