"""`python -m llmexp.coord_check [overrides]`: an entry point; the command is `llmexp.cli.coord_check`."""

import sys

from llmexp.cli.coord_check import main

if __name__ == "__main__":
    sys.exit(main())
