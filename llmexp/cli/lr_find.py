"""`python -m llmexp.lr_find [overrides]`: the lr range test alone, `python -m llmexp lr=find` without the
training that follows (`train.lr_find_only=true`). It writes lr_find.json and lr_find.png to the run directory
and prints the pick; `python -m llmexp lr=<the pick> [the same overrides]` then trains with it."""

from __future__ import annotations

import sys

from llmexp.cli.main import main as llmexp_main


def main() -> None:
    # before the user's own overrides, so that theirs (train.lr_find_steps=..., a run directory) follow as usual
    sys.argv[1:1] = ["lr=find", "train.lr_find_only=true"]
    llmexp_main()
