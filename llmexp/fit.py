"""`python -m llmexp.fit SWEEP_DIR ... [--target-params N] [--out DIR]`: an entry point; the command is
`llmexp.cli.fit`."""

import sys

from llmexp.cli.fit import main

if __name__ == "__main__":
    sys.exit(main())
