"""`python -m llmexp.fit SWEEP_DIR ...`: an entry point; the command is `llmexp.cli.fit`."""

from llmexp.cli.fit import main
from llmexp.process import run_entry

if __name__ == "__main__":
    run_entry(main)
