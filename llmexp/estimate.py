"""`python -m llmexp.estimate [overrides]`: an entry point; the command is `llmexp.cli.estimate`."""

import sys

from llmexp.cli.estimate import main

if __name__ == "__main__":
    sys.exit(main())
