"""Where things live and how they are written: the config tree, run ids, safe path components, the one
atomic file writer, the run-directory lock. No torch here."""

from __future__ import annotations

import datetime as dt
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]+")


def conf_dir() -> Path:
    """The Hydra config tree, `llmexp/conf/`: package data, so a checkout, an editable install and a
    wheel all hold it at the same place."""
    here = Path(__file__).resolve().parent / "conf"
    if not (here / "config.yaml").is_file():
        raise FileNotFoundError(f"llmexp's config tree is missing ({here}/config.yaml); reinstall llmexp")
    return here


def safe_name(text: str, max_len: int = 120) -> str:
    """A single path component: no separators, no `..`, no NUL, never empty."""
    cleaned = _UNSAFE.sub("_", text.replace("\x00", "")).strip("._") or "run"
    return cleaned[:max_len]


def _start_time(pid: int) -> dt.datetime:
    """A process's start time; the launcher parent's is the same for every local rank."""
    import psutil

    return dt.datetime.fromtimestamp(psutil.Process(pid).create_time())


def run_id() -> str:
    """A run directory name that every rank of one launch agrees on.

    `${now:}` would be resolved separately on each rank (and may straddle a second), so
    distributed ranks derive the id from their common parent (torchrun / accelerate launch),
    the SLURM job, or (several nodes) torchrun's `--rdzv_id`; a plain run uses the current time
    and its own pid. Several nodes without SLURM or an rdzv id: set LLMEXP_RUN_ID or hydra.run.dir.
    """
    if os.environ.get("LLMEXP_RUN_ID"):
        return safe_name(os.environ["LLMEXP_RUN_ID"])
    if os.environ.get("SLURM_JOB_ID") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"slurm-{safe_name(os.environ['SLURM_JOB_ID'])}"
    rdzv_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    multi_node = int(os.environ.get("WORLD_SIZE", "1")) > int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if multi_node and rdzv_id not in ("", "none"):  # torchrun --rdzv_id: the one name all nodes share
        return f"torchrun-{safe_name(rdzv_id)}"
    pid = os.getppid() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else os.getpid()
    stamp = _start_time(pid) if pid != os.getpid() else dt.datetime.now()
    return f"{stamp:%Y-%m-%d}/{stamp:%H-%M-%S}-{pid}"


def register_resolvers() -> None:
    """Register `${llmexp_run_id:}` and `${llmexp_safe:...}` once."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("llmexp_run_id"):
        OmegaConf.register_new_resolver("llmexp_run_id", run_id, use_cache=True)
    if not OmegaConf.has_resolver("llmexp_safe"):
        OmegaConf.register_new_resolver("llmexp_safe", safe_name)


@contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a file to be written so that readers see the old one or the new one, never half of one:
    every llmexp file written in place (summary.json, report.md, plots, metrics.jsonl on resume, a
    scrubbed `.hydra/` file, a job's pickle) goes through here.

    A unique temp file beside the target (concurrent writers never share one) is fsync'd, then
    renamed over it; on any failure the temp file is removed and the old file stays.
    """
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
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
    """JSON through write_text_atomic."""
    import json

    write_text_atomic(path, json.dumps(obj, indent=2, default=str))


def study_journal(sweep_dir: Path) -> Path:
    """Where an optuna search keeps its study (`sweep=random|tpe`): an optuna JournalStorage file, study
    name `STUDY_NAME`, safe on a shared filesystem. Trial number N is the sweep's job N (`SWEEP_DIR/N`)."""
    return Path(sweep_dir) / "study.journal"  # not in .llmexp/, which the local launcher removes after each batch


STUDY_NAME = "llmexp"
"""The optuna study's name inside `study_journal`."""

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
