"""`python -m server [flags]` == `spindle serve [flags]`; `python -m server render [flags]` == `spindle render`."""

import sys

from server.cli import main

if __name__ == "__main__":  # a spawned child (multiprocessing, anyio.to_process) re-imports this as __mp_main__
    sys.exit(main(sys.argv[1:] if sys.argv[1:2] == ["render"] else ["serve", *sys.argv[1:]]))
