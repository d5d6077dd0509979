"""Errors that map to exit codes, and the guard that turns them into codes and messages."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

EXIT_OK, EXIT_ERROR, EXIT_USER, EXIT_DIVERGED = 0, 1, 2, 3
STATUS_EXIT = {"completed": EXIT_OK, "early_stopped": EXIT_OK, "diverged": EXIT_DIVERGED,
               "preempted": EXIT_ERROR, "failed": EXIT_ERROR}


class UserError(ValueError):
    """A user's mistake (config, data, paths). The message names the key, file or line and the fix."""


def run_guarded(cfg: DictConfig) -> int:
    """Validate, then train; return the exit code. User errors print one clear message, no traceback."""
    from llmexp.preflight import check_environment
    from llmexp.validation import validate

    try:  # (the CLI ran both before Hydra did anything; a sweep job runs them here, in its own process)
        validate(cfg)
        check_environment(cfg)  # bf16 support, world size, files: before anything loads
        from llmexp.train import train

        result = train(cfg)
    except UserError as err:
        return user_error_exit(err)
    return STATUS_EXIT[result.status]


_last_user_error: str | None = None


def user_error_exit(err: UserError) -> int:
    """Print a user's mistake as one line (secrets scrubbed), keep it for the sweep's record of this job, exit 2."""
    from llmexp.security import scrub_text

    global _last_user_error
    _last_user_error = scrub_text(str(err))
    print(f"llmexp: error: {_last_user_error}", file=sys.stderr)
    return EXIT_USER


def last_user_error() -> str | None:
    """The message of the last user error in this process: a sweep job's record shows it, not just "exit 2"."""
    return _last_user_error
