"""Names on disk: safe path components, and the run id every rank of one launch agrees on."""

from __future__ import annotations

import datetime as dt
import functools
import os
import re

_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]+")


def safe_name(text: str, max_len: int = 120) -> str:
    """A single path component: no separators, no `..`, no NUL, never empty."""
    return (_UNSAFE.sub("_", text.replace("\x00", "")).strip("._") or "run")[:max_len]


def run_id() -> str:
    """A run directory name that every rank of one launch agrees on: `${now:}` would be resolved on each rank (and
    may straddle a second), so ranks derive it from their common parent (torchrun / accelerate launch), the SLURM job,
    or torchrun's `--rdzv_id` (several nodes); a plain run from the time it first asked and its pid. Several nodes
    without SLURM or an rdzv id: set LLMEXP_RUN_ID or hydra.run.dir."""
    if os.environ.get("LLMEXP_RUN_ID"):
        return safe_name(os.environ["LLMEXP_RUN_ID"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if os.environ.get("SLURM_JOB_ID") and world > 1:
        return f"slurm-{safe_name(os.environ['SLURM_JOB_ID'])}"
    rdzv_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if world > int(os.environ.get("LOCAL_WORLD_SIZE", "1")) and rdzv_id not in ("", "none"):
        return f"torchrun-{safe_name(rdzv_id)}"  # several nodes: torchrun --rdzv_id, the one name they all share
    if world > 1:  # the launcher parent's start time: the same for every local rank
        import psutil

        pid = os.getppid()
        stamp = dt.datetime.fromtimestamp(psutil.Process(pid).create_time())
    else:
        pid, stamp = os.getpid(), _first_asked()
    return f"{stamp:%Y-%m-%d}/{stamp:%H-%M-%S}-{pid}"


@functools.cache
def _first_asked() -> dt.datetime:
    """The time this process first asked for its run id: every composition in one process (the CLI's check, then
    `@hydra.main`'s own) names the same directory, the one the CLI checked and locked."""
    return dt.datetime.now()
