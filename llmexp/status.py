"""`python -m llmexp.status DIR [--watch]`: an entry point; the command is `llmexp.report.status`."""

import sys

from llmexp.report.status import main

if __name__ == "__main__":
    sys.exit(main())
