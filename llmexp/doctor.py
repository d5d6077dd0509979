"""`python -m llmexp.doctor RUN_DIR`: an entry point; the command is `llmexp.report.doctor`."""

import sys

from llmexp.report.doctor import main

if __name__ == "__main__":
    sys.exit(main())
