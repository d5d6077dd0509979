"""A content-addressed cache of directories (tokenizers, token arrays) that is never half-written.

An entry is `<root>/<kind>/<key>/`. It is built in a sibling temp directory and renamed into
place only when complete, so a reader sees either nothing or the whole entry. A per-key file
lock serialises builders: of two sweep jobs that miss at once, one builds and the other waits,
then finds the entry. Temp directories left by a killed builder are removed by the next one.
No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from llmexp.rundir.files import staged_dir

COMPLETE_MARKER = "meta.json"
"""Written last inside an entry; an entry without it is not an entry."""


def hash_obj(obj: Any) -> str:
    """A short stable hash of JSON-able data (dict order does not matter)."""
    text = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def hash_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """The sha256 of a file's bytes (user data is keyed by content, not by mtime)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def save_array(directory: Path, name: str, array: np.ndarray) -> None:
    """Write `<name>.npy` (the entry's publish fsyncs it: `rundir.files.staged_dir`)."""
    with open(directory / f"{name}.npy", "wb") as f:
        np.save(f, array, allow_pickle=False)


def save_json(path: Path, obj: Any) -> None:
    """Write JSON (fsync'd with the entry)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)


def load_meta(entry: Path) -> dict[str, Any] | None:
    """The entry's metadata, or None when the entry is absent (or, impossibly, incomplete)."""
    try:
        return json.loads((entry / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def get_or_build(root: Path, kind: str, key: str,
                 build: Callable[[Path], dict[str, Any]]) -> tuple[Path, dict[str, Any], bool]:
    """Return (entry dir, its meta, cache hit?). On a miss, `build(tmp_dir)` fills a temp dir and
    returns the meta; the dir is renamed into place after the meta is written (`rundir.files.staged_dir`).
    If `build` raises, the temp dir is removed and nothing is published (a full disk: DiskFull)."""
    entry = Path(root).expanduser() / kind / key
    meta = load_meta(entry)
    if meta is not None:
        return entry, meta, True
    lock_path = Path(root).expanduser() / "locks" / f"{kind}-{key}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(lock_path):
        meta = load_meta(entry)  # another process may have built it while we waited
        if meta is not None:
            return entry, meta, True
        for stale in entry.parent.glob(f".{key}.tmp-*"):  # left by a killed builder; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        # (a directory without its marker in the way cannot be ours to trust: the publish replaces it)
        with staged_dir(entry, staging=entry.parent / f".{key}.tmp-{os.getpid()}") as tmp:
            meta = build(tmp)
            save_json(tmp / COMPLETE_MARKER, meta)
    return entry, meta, False
