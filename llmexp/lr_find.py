"""`python -m llmexp.lr_find [overrides]`: an entry point; the command is `llmexp.cli.lr_find`."""

from llmexp.cli.lr_find import main

if __name__ == "__main__":
    main()
