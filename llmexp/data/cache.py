"""A content-addressed cache of directories (tokenizers, token arrays) that is never half-written, and whose
entries are verified on read.

An entry `<root>/<kind>/<key>/` is built in a sibling temp directory and renamed into place complete
(`rundir.files.staged_dir`). A per-key file lock serialises builders: of two sweep jobs that miss at once, one
builds and the other waits, then finds the entry. An entry's `meta.json` lists the size and sha256 of each of its
files, and a hit checks them (about a second per GB read); what counts as damage, a miss rebuilt under the lock with
one warning (`cached`): docs/explanation/bad-input.md ("Caches are not refused but rebuilt"). No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from filelock import FileLock

from llmexp.errors import UserError, first_line
from llmexp.rundir.files import staged_dir, write_json_atomic
from llmexp.rundir.readers import Damaged, file_sha256, load_json, reader

COMPLETE_MARKER = "meta.json"
"""Written last inside an entry; an entry without it is not an entry."""


def hash_obj(obj: Any) -> str:
    """A short stable hash of JSON-able data (dict order does not matter)."""
    text = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def save_array(directory: Path, name: str, array: np.ndarray) -> None:
    """Write `<name>.npy` (the entry's publish fsyncs it: `rundir.files.staged_dir`)."""
    np.save(directory / f"{name}.npy", array, allow_pickle=False)


@reader
def load_meta(marker: Path) -> dict[str, Any] | None:
    """An entry's metadata (its `meta.json`), or None when the entry is absent or incomplete; a cache: a marker that
    cannot be read is a miss."""
    meta = load_json(marker, load_meta)
    if not all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], int) and isinstance(f[1], str)
               for f in meta.get(FILES_KEY, {}).values()):
        raise Damaged(marker, f"its {FILES_KEY} are not [size, sha256] pairs")
    return meta


def warn(message: str) -> None:
    """A warning on stderr, as llmexp's errors are printed (the data layer runs before any run logger)."""
    sys.stderr.write(f"llmexp: warning: {message}\n")
    sys.stderr.flush()


def save_cache(path: Path, data: object, redo: str) -> None:
    """Write a small JSON cache back; one that cannot be written (a directory in the way) costs `redo` next run,
    not this run."""
    try:
        write_json_atomic(path, data)
    except OSError as err:
        warn(f"{path} cannot be written ({type(err).__name__}: {err}); {redo} next run")


FILES_KEY = "files"
"""meta.json's record of the entry's files: relative path -> [size in bytes, sha256]."""


def damage(entry: Path, meta: dict[str, Any]) -> str | None:
    """Which recorded file of the entry is missing or changed, or None. A meta.json without the record, or with an
    empty one (every build writes files), is damage too: nothing would tell a deleted file (an SFT entry's mask:
    training on the prompts) from one never written."""
    if FILES_KEY not in meta:
        return f"its {COMPLETE_MARKER} has no record of its files"
    if not meta[FILES_KEY]:
        return f"its {COMPLETE_MARKER} records no files, and every entry has some"
    for name, (size, digest) in meta[FILES_KEY].items():
        path = entry / name
        try:
            if path.stat().st_size != size:
                return f"{name} is {path.stat().st_size} bytes, {size} were written"
            if file_sha256(path) != digest:
                return f"{name} changed since it was written (sha256)"
        except OSError as err:
            return f"{name} cannot be read ({os.strerror(err.errno or 0) or err})"
    return None


def _verified(entry: Path) -> dict[str, Any] | None:
    """The meta of a whole, unchanged entry; None when there is none. A damaged one is warned about (the caller
    rebuilds it)."""
    meta = load_meta(entry / COMPLETE_MARKER)  # (a damaged marker is a miss, said once)
    if meta is None:
        if entry.is_dir() and not (entry / COMPLETE_MARKER).exists():
            warn(f"the cache entry {entry} has no {COMPLETE_MARKER}; rebuilding it")
        return None
    if problem := damage(entry, meta):
        warn(f"the cache entry {entry} is damaged ({problem}); rebuilding it")
        return None
    return meta


def get_or_build(root: Path, kind: str, key: str,
                 build: Callable[[Path], dict[str, Any]], rebuild: bool = False) -> tuple[Path, dict[str, Any], bool]:
    """(entry dir, its meta, cache hit?). A hit is verified (`damage`); on a miss `build(tmp_dir)` fills a staging
    directory and returns the meta, to which the files' sizes and sha256 are added, and the entry is published
    (`rundir.files.staged_dir`: nothing if `build` raises; DiskFull on a full disk). `rebuild`: the entry's loader
    could not read it; build it again."""
    entry = Path(root).expanduser() / kind / key
    if not rebuild and (meta := _verified(entry)) is not None:
        return entry, meta, True
    lock_path = Path(root).expanduser() / "locks" / f"{kind}-{key}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(lock_path):
        # another process may have built it while we waited
        if not rebuild and (meta := load_meta(entry / COMPLETE_MARKER)) is not None and damage(entry, meta) is None:
            return entry, meta, True
        for stale in entry.parent.glob(f".{key}.tmp-*"):  # left by a killed builder; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        # (a damaged entry, or a directory without its marker, is not ours to trust: the publish replaces it)
        with staged_dir(entry, staging=entry.parent / f".{key}.tmp-{os.getpid()}") as tmp:
            meta = build(tmp)
            meta[FILES_KEY] = {str(p.relative_to(tmp)): [p.stat().st_size, file_sha256(p)]
                               for p in sorted(tmp.rglob("*")) if p.is_file() and p.name != COMPLETE_MARKER}
            (tmp / COMPLETE_MARKER).write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")
    return entry, meta, False


T = TypeVar("T")


def cached(root: Path, kind: str, key: str, build: Callable[[Path], dict[str, Any]],
           load: Callable[[Path, dict[str, Any]], T]) -> tuple[T, dict[str, Any], bool]:
    """(`load(entry, meta)`, meta, cache hit?) of a verified entry, built on a miss. A hit that `load` cannot
    read (a meta.json edited by hand, or a library that now reads it otherwise) is a miss too: warned about,
    rebuilt, loaded again; what `load` raises then is a real error and propagates."""
    entry, meta, hit = get_or_build(root, kind, key, build)
    try:
        return load(entry, meta), meta, hit
    except Exception as err:  # whatever a reader raises on bytes it cannot parse (a UserError is no such thing)
        if not hit or isinstance(err, UserError):
            raise
        first = first_line(err) or type(err).__name__
        warn(f"the cache entry {entry} cannot be read ({type(err).__name__}: {first}); rebuilding it")
    entry, meta, _ = get_or_build(root, kind, key, build, rebuild=True)
    return load(entry, meta), meta, False
