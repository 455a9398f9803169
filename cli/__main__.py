"""`python -m kvtier.cli` runs the `kvtier` command."""

import sys

from kvtier.cli.main import main

if __name__ == "__main__":
    sys.exit(main())  # its status is the command's (1 for a failure, 2 for bad input)
