"""`python -m llmexp.coord_check [overrides]`: an entry point; the command is `llmexp.cli.coord_check`."""

from llmexp.cli.coord_check import main
from llmexp.process import run_entry

if __name__ == "__main__":
    run_entry(main)
