"""The run- and sweep-directory locks: one llmexp run per run directory, one sweeper per sweep directory."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from llmexp.errors import UserError
from llmexp.rundir.files import atomic_file
from llmexp.rundir.readers import Damaged, entry_of, read_bytes, read_text, reader

LOCK_NAME = ".llmexp.lock"
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")
"""What Hydra writes in `hydra.output_subdir` (`.hydra/`) as a run starts, before llmexp can refuse it."""


_held_locks: dict[str, object] = {}
"""Directory -> the lock this process holds on it; kept referenced so that it lasts as long as the process."""
_made_parents: dict[Path, list[Path]] = {}
"""Directory -> the missing parents `_lock` created for it, deepest first."""


def lock_run_dir(run_dir: Path | str) -> None:
    """Lock `run_dir` for the life of this process, or raise UserError naming the pid that holds it (a second run
    would interleave metrics, checkpoints and summaries). Only rank 0 locks: all ranks share the directory."""
    if os.environ.get("RANK", "0") == "0":
        _lock(Path(run_dir), "run", "hydra.run.dir")


def lock_sweep_dir(sweep_dir: Path | str) -> None:
    """Lock `sweep_dir` for the life of this sweeper, or raise UserError naming the pid that holds it: two sweepers
    would launch the same jobs twice and, for a search, tell the same study's trials twice."""
    _lock(Path(sweep_dir), "sweep", "hydra.sweep.dir")


def _lock(directory: Path, what: str, key: str) -> None:
    """An flock (`filelock`) on `DIRECTORY/.llmexp.lock`, which also holds the holder's pid. The kernel drops it
    when the process ends, however it ends (kill -9 included), so a stale file never blocks a rerun or a
    resume; the file descriptor is not inherited by child processes (subprocess closes it)."""
    from filelock import FileLock, Timeout

    made = [parent for parent in directory.parents if not parent.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    if str(path.resolve()) in _held_locks:  # this process holds it already (the CLI, then the sweeper)
        return
    if path.is_dir() and not path.is_symlink():  # (filelock's IsADirectoryError would name no way out)
        raise UserError(f"{path} is a directory where llmexp keeps its lock file; remove it (rmdir {path}) "
                        "and rerun")
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise UserError(f"{directory} is in use by another llmexp {what} (pid {lock_pid(path) or 'unknown'}); wait "
                        f"for it to end, or choose another directory with {key}=...") from None
    path.write_text(f"{os.getpid()}\n")
    _held_locks[str(path.resolve())] = lock
    _made_parents[directory.resolve()] = made


_found: dict[Path, bytes | None] = {}
"""Hydra's config files in the directory the CLI locked, as it found them (None: none), for `put_back_hydra_files`."""


def keep_hydra_files(run_dir: Path | str, subdir: str | None) -> None:
    """Called by the CLI once it locked `run_dir`, before Hydra writes its config files there, in `subdir`
    (`hydra.output_subdir`; null: none). A file that is there but cannot be read (its reader said so) is not kept:
    a refusal leaves Hydra's in its place rather than removing it."""
    _found.clear()
    for path in (Path(run_dir, subdir, n) for n in HYDRA_FILES) if subdir else ():
        if (data := read_hydra_file(path)) is not None or not path.exists():
            _found[path] = data


@reader
def read_hydra_file(path: Path) -> bytes:
    return read_bytes(path, entry_of(read_hydra_file).max_bytes)


def put_back_hydra_files(run_dir: Path) -> None:
    """A run refused in a directory that stays (an earlier run's): Hydra's config files as the CLI found them, so
    that the directory keeps the config it ran with, not the refused one's."""
    # (only those under run_dir: the run's own composition may have resolved a ${now:} anew, elsewhere)
    kept = {path: data for path, data in _found.items() if path.resolve().is_relative_to(run_dir.resolve())}
    for path, data in kept.items():
        if data is None:
            path.unlink(missing_ok=True)
        else:
            with atomic_file(path, "wb") as f:
                f.write(data)
    for folder in {path.parent for path in kept}:
        with contextlib.suppress(OSError):  # (an empty one: the directory had none)
            folder.rmdir()


def remove_made_parents(run_dir: Path) -> None:
    """The parents the lock made for a refused run's directory (`outputs/<date>/`), where they are empty: never
    one that was there before."""
    for folder in _made_parents.get(run_dir.resolve(), []):
        with contextlib.suppress(OSError):
            folder.rmdir()


def wait_for_lock(run_dir: Path, waiting: Callable[[int | None], None], poll_s: float = 2.0) -> None:
    """Block while another process holds `run_dir`'s lock; `waiting(pid)` is called once first when one does."""
    from filelock import FileLock, Timeout

    path = Path(run_dir) / LOCK_NAME
    if not path.exists():
        return
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        waiting(lock_pid(path))
        lock.acquire(poll_interval=poll_s)
    lock.release()


@reader
def lock_pid(path: Path) -> int | None:
    """The pid a lock file holds (whether or not that process still holds the lock), or None."""
    text = read_text(path, entry_of(lock_pid).max_bytes).strip()
    if text and not (text.isdigit() and len(text) <= 9):  # (empty: the holder has not written its pid yet)
        raise Damaged(path, f"holds {text[:20]!r}, not a pid")
    return int(text) if text else None


def lock_holder(run_dir: Path) -> int | None:
    """The pid of the process holding `run_dir`'s lock now, or None, never taking the lock (a run starting then must
    not find it held by a reader): from /proc/locks on Linux, else the lock file's pid if alive. A run on another
    host (a SLURM node) is not seen: ask the scheduler."""
    path = Path(run_dir) / LOCK_NAME
    try:
        st = path.stat()
    except OSError:
        return None
    pid = lock_pid(path)  # (None: a holder that has not written it yet, or a lock taken by filelock alone)
    try:
        locks = Path("/proc/locks").read_text()
    except OSError:
        import psutil

        return pid if pid is not None and psutil.pid_exists(pid) else None
    node = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holders = [int(fields[4]) for fields in (line.split() for line in locks.splitlines())
               if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == node]
    return (pid if pid in holders else holders[0]) if holders else None
