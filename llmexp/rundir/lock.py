"""The run-directory lock: one llmexp run per directory at a time."""

from __future__ import annotations

import os
from pathlib import Path

LOCK_NAME = ".llmexp.lock"


_held_locks: dict[str, object] = {}
"""Run-directory locks this process holds, by directory; kept referenced so they last as long as the process."""


def lock_run_dir(run_dir: Path) -> None:
    """Lock `run_dir` for the life of this process, or raise UserError naming the pid that holds it.

    A second run on the same directory would interleave metrics, checkpoints and summaries. The lock is
    an flock (`filelock`) on `RUN_DIR/.llmexp.lock`, which also holds the holder's pid; the kernel drops it
    when the process ends, however it ends (kill -9 included), so a stale file never blocks a rerun or a
    resume. Only the first rank of a distributed launch locks (all ranks share the directory). Locking a
    directory this process holds already does nothing.
    """
    from filelock import FileLock, Timeout

    from llmexp.errors import UserError

    if os.environ.get("RANK", "0") != "0":
        return
    run_dir = Path(run_dir)
    if str(run_dir.resolve()) in _held_locks:  # this process holds it already (the CLI, then its task)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            holder = path.read_text().strip() or "unknown"
        except OSError:
            holder = "unknown"
        raise UserError(f"{run_dir} is in use by another llmexp run (pid {holder}); wait for it to end, or "
                        "choose another directory with hydra.run.dir=...") from None
    path.write_text(f"{os.getpid()}\n")
    _held_locks[str(run_dir.resolve())] = lock
