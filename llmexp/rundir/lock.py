"""The run-directory lock: one llmexp run per directory at a time."""

from __future__ import annotations

import os
from pathlib import Path

LOCK_NAME = ".llmexp.lock"


_held_locks: list[object] = []
"""Run-directory locks this process holds; kept referenced so they last as long as the process."""


def lock_run_dir(run_dir: Path) -> None:
    """Lock `run_dir` for the life of this process, or raise UserError naming the pid that holds it.

    A second run on the same directory would interleave metrics, checkpoints and summaries. The lock is
    an flock (`filelock`) on `RUN_DIR/.llmexp.lock`, which also holds the holder's pid; the kernel drops it
    when the process ends, however it ends (kill -9 included), so a stale file never blocks a rerun or a
    resume. Only the first rank of a distributed launch locks (all ranks share the directory).
    """
    from filelock import FileLock, Timeout

    from llmexp.errors import UserError

    if os.environ.get("RANK", "0") != "0":
        return
    run_dir = Path(run_dir)
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
    _held_locks.append(lock)


def lock_holder(run_dir: Path) -> int | None:
    """The pid of the process holding `run_dir`'s lock now, or None; read-only, never taking the lock (a run
    starting at that moment must not find it held by a reader).

    Linux lists every flock in /proc/locks by device and inode; elsewhere, the pid in the lock file counts if
    that process is alive. A run on another host (a SLURM node) is not seen: ask the scheduler."""
    path = Path(run_dir) / LOCK_NAME
    try:
        st = path.stat()
        pid = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        with open("/proc/locks") as f:
            locks = f.read()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        return pid
    node = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holders = [int(fields[4]) for fields in (line.split() for line in locks.splitlines())
               if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == node]
    return (pid if pid in holders else holders[0]) if holders else None
