"""`python -m server [flags]` == `spindle serve [flags]`; `python -m server render [flags]` == `spindle render`."""

import sys

from server.cli import main

sys.exit(main(sys.argv[1:] if sys.argv[1:2] == ["render"] else ["serve", *sys.argv[1:]]))
