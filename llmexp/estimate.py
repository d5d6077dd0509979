"""`python -m llmexp.estimate [overrides]`: an entry point; the command is `llmexp.cli.estimate`."""

from llmexp.cli.estimate import main
from llmexp.process import run_entry

if __name__ == "__main__":
    run_entry(main)
