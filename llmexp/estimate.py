"""`python -m llmexp.estimate [overrides]`: an entry point; the command is `llmexp.cli.estimate`."""

import sys

from llmexp.cli.estimate import main
from llmexp.cli.main import settle_for_exit

if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        settle_for_exit()
