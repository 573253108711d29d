"""Engine core subprocess: `python -m engine --config JSON`. Frames on stdin / the original stdout."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import traceback

from engine.config import EngineConfig
from engine.ipc import FrameReader, FrameWriter, die_with_parent
from engine.messages import LoadFailed, ToEngine


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m engine")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = parser.parse_args()
    die_with_parent()  # EOF on stdin ends the step loop; this also covers a step that never returns
    # Ctrl-C and a process group's SIGTERM (systemd) go to the server, which drains, then closes our stdin
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # frames go to the original stdout; anything a library prints goes to stderr instead
    out_fd = os.dup(1)
    os.dup2(2, 1)
    writer = FrameWriter(out_fd)
    reader: FrameReader[ToEngine] = FrameReader(0, ToEngine)
    logging.basicConfig(level=os.environ.get("SPINDLE_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s engine %(levelname)s %(message)s")
    try:
        config = EngineConfig(**json.loads(args.config))
        from engine.loop import serve  # heavy imports (torch) after the pipes are set up
    except Exception as e:  # noqa: BLE001 - any load failure is reported to the parent, then we exit
        writer.send(LoadFailed(f"{type(e).__name__}: {e}"))
        sys.exit(1)
    try:
        serve(config, reader, writer)
    except (BrokenPipeError, KeyboardInterrupt):
        pass
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        try:
            writer.send(LoadFailed(f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        sys.exit(1)


if __name__ == "__main__":
    main()
