"""`python -m llmexp.fit SWEEP_DIR ... [--target-params N] [--out DIR]`: an entry point; the command is
`llmexp.cli.fit`."""

import sys

from llmexp.cli.fit import main
from llmexp.cli.main import settle_for_exit

if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        settle_for_exit()
