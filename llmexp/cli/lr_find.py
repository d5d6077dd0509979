"""`python -m llmexp.lr_find [overrides]`: the lr range test alone, `python -m llmexp lr=find` without the
training that follows (`train.lr_find_only=true`). It writes lr_find.json and lr_find.png to the run directory
and prints the pick; `python -m llmexp lr=<the pick> [the same overrides]` then trains with it."""

from __future__ import annotations

import sys

from llmexp.cli.main import main as llmexp_main
from llmexp.config.validation import is_lr_find
from llmexp.errors import UserError
from llmexp.rundir.redact import print_user_error


def other_lr(args: list[str]) -> str | None:
    """The user's own `lr=<value>` override (the last one wins, as in Hydra) when it is not `find`: it would replace
    the `lr=find` this command runs with, so the range test could not run."""
    for arg in reversed(args):
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") == "lr":
            return None if is_lr_find(value.strip("'\"")) else arg
    return None


def main() -> None:
    if (given := other_lr(sys.argv[1:])) is not None:
        sys.exit(print_user_error("llmexp", UserError(
            f"{given}: python -m llmexp.lr_find picks the lr itself (a range test), so it takes none; drop {given} "
            f"to find one, or train with it: python -m llmexp {given} [the same overrides]")))
    # before the user's own overrides, so that theirs (train.lr_find_steps=..., a run directory) follow as usual
    sys.argv[1:1] = ["lr=find", "train.lr_find_only=true"]
    llmexp_main()
