"""How llmexp writes in place: a file (`atomic_file`) or a whole directory (`staged_dir`), so that readers see
the old one or the new one, never half of one; and a full disk, named as such (`DiskFull`). No torch here."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from llmexp.errors import first_line

FULL_DISK_FREE_BYTES = 1 << 20
"""A write that fails with less than this left on its filesystem failed for lack of space."""


@contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """`path` opened to be written in place: a unique temp file beside it (concurrent writers never share one),
    fsync'd, then renamed over it; on any failure the temp file is removed and the old file stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # (text: a path named in bytes that are not UTF-8 is written escaped, as Python prints it)
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8", "errors": "backslashreplace"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_file(path) as f:
        f.write(text)


def write_json_atomic(path: Path, obj: object) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, default=str))


def unwritable(directory: Path, err: OSError) -> str:
    """What a report tool says when it cannot write in `directory` (read-only, a directory named report.md)."""
    return f"cannot write in {directory} ({err.strerror or type(err).__name__}: {err.filename2 or err.filename})"


class DiskFull(RuntimeError):
    """A write ran out of space. The message names the path and the free bytes; the partial write was removed
    and what was there before is untouched."""


def disk_full_error(err: BaseException, path: Path) -> DiskFull | None:
    """A DiskFull naming `path` if `err` (raised while writing under `path`) means the disk is full: ENOSPC/EDQUOT
    say so directly; torch's zip writer turns them into a RuntimeError ("unexpected pos", "file write failed"), so a
    failed write on a filesystem with almost no space left (under FULL_DISK_FREE_BYTES) counts too. Call it before
    removing the partial write, whose bytes are what filled the disk."""
    full = isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)
    free_bytes = _free_bytes(path)
    if not full and not (free_bytes is not None and free_bytes < FULL_DISK_FREE_BYTES):
        return None
    free = f"{free_bytes / 2**20:.1f} MiB free" if free_bytes is not None else "free space unknown"
    return DiskFull(f"no space left on device while writing {path} ({free}; {type(err).__name__}: "
                    f"{first_line(err)})")


def _free_bytes(path: Path) -> int | None:
    for candidate in (Path(path), *Path(path).parents):
        with suppress(OSError):
            return shutil.disk_usage(candidate).free
    return None


def fsync_path(path: Path) -> None:
    """fsync a file or directory. Directories on some network filesystems refuse: that is fine."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if not (Path(path).is_dir() and err.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False where unsupported."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def replace_dir(tmp: Path, final: Path, *, aside: Path | None = None,
                keep: Callable[[Path], bool] | None = None) -> None:
    """Rename the finished directory `tmp` to `final`. An existing directory of that name is swapped out atomically
    where the kernel can (renameat2), else renamed to `aside` first (default `.<name>.old-<pid>`; put back if the second
    rename fails); then deleted. A symbolic link of that name, or a directory that `keep` says is not ours to delete, is
    moved aside as `<name>.displaced-<ns>`, never followed nor deleted through."""
    tmp, final = Path(tmp), Path(final)
    if final.is_symlink() or (keep is not None and final.exists() and keep(final)):
        os.replace(final, final.with_name(f"{final.name}.displaced-{time.time_ns()}"))
    if not final.exists():
        os.replace(tmp, final)
        return
    if _exchange(tmp, final):  # now `tmp` holds the old copy
        _remove(tmp)
        return
    old = aside or final.with_name(f".{final.name}.old-{os.getpid()}")
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        os.replace(old, final)  # put the old copy back
        raise
    _remove(old)


def _remove(path: Path) -> None:
    """Delete what a publish replaced: a directory, or a plain file where one stood (a damaged cache entry)."""
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


Replace = Callable[[Path, Path], None]
"""How a finished staging directory takes its final name: `replace_dir`, or a caller's variant of it."""


def stage_dir(staging: Path) -> Path:
    """A fresh, empty staging directory at `staging`: an earlier, failed attempt's leftover there is removed."""
    staging = Path(staging)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish_dir(staging: Path, final: Path, replace: Replace = replace_dir) -> None:
    """Make a finished staging directory visible under its final name in one step: fsync it, rename it
    (`replace`: an existing `final` is swapped out, then deleted), fsync the parent. Readers see the old or
    the new directory, never a mix or nothing."""
    # every file and directory bottom-up, before the rename: else a crash could leave it naming unwritten files
    for dirpath, _, filenames in os.walk(staging, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))
    replace(Path(staging), Path(final))
    fsync_path(Path(final).parent)


@contextmanager
def staged_dir(final: Path, staging: Path, replace: Replace = replace_dir) -> Iterator[Path]:
    """A directory that appears at `final` complete, or not at all: yields `staging` (beside `final`, so that
    publishing is a rename), emptied, and publishes it (`publish_dir`) as the block ends. If either raises, the
    staging directory is removed, and a full disk becomes `DiskFull` naming `final`. (DeepSpeed and FSDP fill
    shards on every rank, so they call `stage_dir` and `publish_dir` themselves.)"""
    try:
        yield stage_dir(staging)
        publish_dir(staging, final, replace)
    except BaseException as err:
        full = disk_full_error(err, final) if isinstance(err, Exception) else None
        shutil.rmtree(staging, ignore_errors=True)
        if full is not None:
            raise full from None
        raise
