"""Checkpoints that never lose work: atomic save, verification, safe rotation and resume.

`.tmp-step_<N>-<host>-<pid>/` is filled by the trainer's `write(tmp)`, then `manifest.json` (every file's size and
sha256), all fsynced; one rename publishes it as `step_<N>/`, and only then does `rotate()` delete old ones. So a
crash leaves the previous checkpoints or the new one complete. Only complete checkpoints are listed, loaded or
rotated; nothing is deleted through a symbolic link (docs/explanation/checkpoints-and-resume.md).
No torch at import time: this module sits beside the config path.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

from llmexp.checkpoint.serialize import CorruptCheckpoint
from llmexp.rundir.files import DiskFull as DiskFull  # what a full disk during a save raises (re-exported)
from llmexp.rundir.files import fsync_path, replace_dir, staged_dir
from llmexp.rundir.readers import Damaged, MiB, file_sha256, parse_json, read_text

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d+)$")
# A `step_<N>` that was in the way of a save (incomplete, foreign or a link), moved aside by _publish.
DISPLACED_DIR = re.compile(r"^step_(\d+)\.displaced-\d+$")
# Our temporary dirs: a save in progress (step_N), a swapped-out old copy (old-step_N) or a checkpoint being deleted
# (del-step_N). Host and pid say whose it is, so a dead process's leftovers can be removed, never a live writer's.
TMP_DIR = re.compile(r"^\.tmp-(?P<tag>(?:old-|del-)?step_\d+)-(?P<host>.+)-(?P<pid>\d+)$")
# A leftover from another host cannot be probed for liveness; no save takes this long.
FOREIGN_TMP_STALE_S = 6 * 3600.0

T = TypeVar("T")


def _sha256_all(paths: list[Path]) -> list[str]:
    """Hash files in parallel: hashlib releases the GIL, and a 7B run's checkpoint (weights, Adam moments, per-rank
    ZeRO shards) is tens of GB in several files."""
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(paths), os.cpu_count() or 1))) as pool:
        return list(pool.map(file_sha256, paths))


def _files_under(root: Path) -> dict[str, Path]:
    """Every file under root by its posix path relative to root (the manifest excluded)."""
    found = ((path.relative_to(root).as_posix(), path) for path in root.rglob("*") if not path.is_dir())
    return dict(sorted((rel, path) for rel, path in found if rel != MANIFEST))


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "_", socket.gethostname()) or "host"


def _tmp_dir(root: Path, tag: str) -> Path:
    return root / f".tmp-{tag}-{_host()}-{os.getpid()}"


def _step_of(path: Path) -> int | None:
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def _write_manifest(tmp: Path, step: int, extra: Mapping[str, Any] | None) -> None:
    found = _files_under(tmp)
    files = {rel: {"size": path.stat().st_size, "sha256": digest}
             for (rel, path), digest in zip(found.items(), _sha256_all(list(found.values())), strict=True)}
    manifest = {"format_version": FORMAT_VERSION, "step": step, "created_unix": time.time(),
                "files": files, "extra": dict(extra or {})}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest of a checkpoint dir; CorruptCheckpoint if it is missing or malformed."""
    file = path / MANIFEST
    try:
        manifest = parse_json(read_text(file, 64 * MiB), file)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{file}: missing; the checkpoint is incomplete") from None
    except (OSError, Damaged) as err:
        raise CorruptCheckpoint(f"{file}: unreadable manifest ({err})") from None
    if not (isinstance(manifest, dict) and isinstance(manifest.get("files"), dict)
            and isinstance(manifest.get("step"), int)):
        raise CorruptCheckpoint(f"{file}: malformed manifest (no 'files' or 'step')")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CorruptCheckpoint(f"{file}: format_version {manifest.get('format_version')!r} is not "
                                f"{FORMAT_VERSION}; written by another llmexp version")
    return manifest


def verify_checkpoint(path: Path, *, full: bool = True) -> None:
    """Check every file the manifest lists: size always, sha256 too when `full`. Raises CorruptCheckpoint naming the
    first bad file (missing, wrong size, wrong hash, or present but not listed: a loader that looks for optional
    files must not pick up a stranger)."""
    manifest = read_manifest(path)
    if _step_of(path) not in (None, manifest["step"]):  # a `step_<N>` dir holds step N
        raise CorruptCheckpoint(f"{path / MANIFEST}: says step {manifest['step']} but the dir is {path.name}")
    if unlisted := sorted(set(_files_under(path)) - set(manifest["files"])):
        raise CorruptCheckpoint(f"{path / unlisted[0]}: not listed in the manifest (added after the save?)")
    for rel, entry in manifest["files"].items():
        file = path / rel
        if not file.resolve().is_relative_to(path.resolve()):
            raise CorruptCheckpoint(f"{path / MANIFEST}: lists {rel!r}, which is outside the checkpoint")
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{file}: missing (listed in the manifest)") from None
        if size != entry.get("size"):
            raise CorruptCheckpoint(f"{file}: {size} bytes, the manifest says {entry.get('size')} (truncated?)")
    if full:
        files = [path / rel for rel in manifest["files"]]
        for file, digest, entry in zip(files, _sha256_all(files), manifest["files"].values(), strict=True):
            if digest != entry.get("sha256"):
                raise CorruptCheckpoint(f"{file}: sha256 does not match the manifest (the file was altered)")


def _is_complete(path: Path) -> bool:
    try:
        verify_checkpoint(path, full=False)
    except CorruptCheckpoint:
        return False
    return True


def _dirs(root: Path, name: re.Pattern[str]) -> list[tuple[Path, re.Match[str]]]:
    """The directories in `root` whose names match `name`, with the match; never a link."""
    found = [(path, name.match(path.name)) for path in (root.iterdir() if root.is_dir() else [])]
    return [(path, match) for path, match in found if match and path.is_dir() and not path.is_symlink()]


def _step_dirs(root: Path) -> list[Path]:
    """Every `step_<N>` directory, complete or not, oldest first."""
    return [path for path, _ in sorted(_dirs(root, STEP_DIR), key=lambda found: int(found[1].group(1)))]


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints (manifest present, every size right) under `root`, oldest first."""
    return [p for p in _step_dirs(root) if _is_complete(p)]


def save_checkpoint(root: Path, step: int, write: Callable[[Path], None], *, keep: int,
                    best_step: int | None = None, extra: Mapping[str, Any] | None = None) -> Path:
    """Write a checkpoint atomically as `root/step_<step>`, then rotate; return its path. `write(tmp_dir)` puts the
    files there (any layout); `extra` (JSON data) is stored in the manifest. If anything raises, the partial tmp
    dir is removed (after a hard kill, by a later rotate)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    with staged_dir(final, staging=_tmp_dir(root, final.name), replace=_publish) as tmp:
        write(tmp)
        _write_manifest(tmp, step, extra)
    rotate(root, keep, best_step, protect=final)
    return final


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished checkpoint's tmp dir to `step_<N>` (`rundir.files.replace_dir`). An existing `step_<N>`
    without a valid manifest (not written here) or a link is moved aside, not deleted; a replaced old copy waits
    as our own `.tmp-old-step_<N>-...` dir, which `rotate` puts back if a crash cuts the replace in two."""
    replace_dir(tmp, final, aside=_tmp_dir(final.parent, f"old-{final.name}"), keep=lambda p: not _is_complete(p))


def rotate(root: Path, keep: int, best_step: int | None, *, protect: Path | None = None) -> None:
    """Delete complete checkpoints beyond the `keep` newest (by step), sparing `step_<best_step>` and `protect`
    (the one just saved). Displaced copies (`step_<N>.displaced-*` holding an llmexp manifest) follow the same
    rule. Also removes this module's tmp dirs left by dead processes (same host: the pid is gone; other hosts:
    older than FOREIGN_TMP_STALE_S)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    _remove_stale_tmp(root)
    complete = list_checkpoints(root)
    spared = set(complete[-keep:]) | {p for p in complete if _step_of(p) == best_step or p == protect}
    doomed = [(path, _step_of(path) or 0) for path in complete if path not in spared]
    if complete:
        oldest_kept = min(_step_of(p) or 0 for p in complete[-keep:])
        doomed += [(path, step) for path, step in _displaced_dirs(root) if step < oldest_kept and step != best_step]
    for path, step in doomed:  # renamed to our tmp name first: a crash half-way leaves a dead process's tmp dir
        trash = _tmp_dir(root, f"del-step_{step}")  # (cleaned later), not a damaged `step_<N>`
        os.replace(path, trash)
        shutil.rmtree(trash)
    if doomed:
        fsync_path(root)


def _displaced_dirs(root: Path) -> list[tuple[Path, int]]:
    """Displaced `step_<N>` copies that llmexp wrote (they hold one of its manifests), with N."""
    found = []
    for path, match in _dirs(root, DISPLACED_DIR):
        try:
            read_manifest(path)
        except CorruptCheckpoint:
            continue  # not ours to judge: kept
        found.append((path, int(match.group(1))))
    return found


def _remove_stale_tmp(root: Path) -> None:
    for path, match in _dirs(root, TMP_DIR):
        if not _is_stale(path, int(match.group("pid")), match.group("host")):
            continue
        tag = match.group("tag")
        original = root / tag.removeprefix("old-")
        if tag.startswith("old-") and not original.exists() and _is_complete(path):
            # A replace was cut between its two renames: put the old copy back.
            os.replace(path, original)
            continue
        shutil.rmtree(path, ignore_errors=True)


def _is_stale(path: Path, pid: int, host: str) -> bool:
    if host == _host():
        import psutil  # (not at import time: this module sits beside the config path)

        return pid != os.getpid() and not psutil.pid_exists(pid)
    try:
        return time.time() - path.stat().st_mtime > FOREIGN_TMP_STALE_S
    except FileNotFoundError:
        return False


def load_with_fallback(root: Path, load: Callable[[Path], T], warn: Callable[[str], None],
                       none_left: str = "the run starts from scratch") -> tuple[Path, T] | None:
    """(path, `load(path)`) of the newest checkpoint that verifies and loads, falling back past any that raise
    CorruptCheckpoint (as load_state and load_tensors do for a bad file); None when none does. Each warning says
    what follows: the older checkpoint tried next, or (`none_left`) what the caller does without one."""
    for link in sorted(root.iterdir()) if root.is_dir() else []:  # a `step_<N>` link was not written here
        if link.is_symlink() and _step_of(link) is not None:
            warn(f"{link} is a symbolic link, not a checkpoint llmexp wrote: ignored "
                 f"(a later save of step {_step_of(link)} moves the link aside)")
    for path, older in pairwise([*reversed(_step_dirs(root)), None]):  # each with the one tried next
        try:
            verify_checkpoint(path, full=True)
            return path, load(path)
        except CorruptCheckpoint as err:
            then = f"falling back to {older.name}" if older else f"and no older one is left, so {none_left}"
            warn(f"checkpoint {path.name} is unusable, {then}: {err}")
    return None
