"""`python -m llmexp`: the front door is `llmexp.cli.main`."""

from llmexp.cli.main import main

if __name__ == "__main__":
    main()
