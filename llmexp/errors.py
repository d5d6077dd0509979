"""Exit codes, and the error that stands for a user's mistake (exit 2)."""

from __future__ import annotations

EXIT_OK, EXIT_ERROR, EXIT_USER, EXIT_DIVERGED = 0, 1, 2, 3
STATUS_EXIT = {"completed": EXIT_OK, "early_stopped": EXIT_OK, "diverged": EXIT_DIVERGED,
               "preempted": EXIT_ERROR, "failed": EXIT_ERROR, "pruned": EXIT_OK}


class UserError(ValueError):
    """A user's mistake (config, data, paths). The message names the key, file or line and the fix."""


class RunFailed(UserError):
    """A user's mistake found after steps ran (a stream's bad row): the run wrote summary.json (`failed`, with
    this message) and keeps its checkpoints, so its directory stays."""


def first_line(text: object, max_chars: int | None = 200) -> str:
    """The first non-blank line of an error's (or a tool's) text, cut to `max_chars`; "" for none: what a one-line
    message quotes of a library's exception, whose text may be empty or run to pages."""
    return (str(text).strip().splitlines() or [""])[0][:max_chars]
