"""`python -m llmexp.coord_check [overrides]`: an entry point; the command is `llmexp.cli.coord_check`."""

import sys

from llmexp.cli.coord_check import main
from llmexp.cli.main import settle_for_exit

if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        settle_for_exit()
