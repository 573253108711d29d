"""`python -m server [flags]` == `spindle serve [flags]`."""

import sys

from server.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
