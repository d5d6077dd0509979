"""`python -m llmexp`: the front door is `llmexp.cli.main`."""

from llmexp.cli.main import cli

if __name__ == "__main__":
    cli()
