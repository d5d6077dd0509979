"""What depends on this machine and launch, checked after `validate` (a pure function of the config) and before
anything loads: the world size against the global batch, files and directories that must exist, the trackers'
packages. It runs in the CLI before Hydra runs, and again in `train.guarded.run_guarded` for sweep jobs.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from llmexp.config.derived import global_batch_problem, parse_batch_size, world_size_from_env
from llmexp.errors import UserError
from llmexp.machine.paths import directory_errors, path_errors
from llmexp.rundir.readers import open_regular


def check_environment(cfg: Any) -> None:
    """Raise one UserError listing every problem of this config on this machine and launch."""
    errors = [*_batch_errors(cfg), *deepspeed_errors(cfg, gpu_visible()), *path_errors(cfg), *_tracking_errors(cfg)]
    if errors:
        raise UserError("cannot run this config here:\n  " + "\n  ".join(errors))


def check_directories(cfg: Any) -> None:
    """The directories this process writes (cache, run or sweep directory), for a sweep whose jobs run elsewhere
    (SLURM): their own files are checked by `check_environment` on the node."""
    if errors := directory_errors(cfg):
        raise UserError("cannot run this config here:\n  " + "\n  ".join(errors))


def gpu_visible() -> bool:
    """A cheap guess, without importing torch, whether CUDA devices are visible to this process."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


def deepspeed_errors(cfg: Any, cuda: bool) -> list[str]:
    """DeepSpeed's CPU accelerator computes in fp32 and bf16 only. `cuda`: whether this process can use a GPU; before
    anything loads, `gpu_visible()`'s guess; as the run starts, torch's answer (a CPU build of torch on a GPU
    machine is the case the guess gets wrong)."""
    if cfg.deepspeed.stage > 0 and cfg.precision.name == "fp16" and not cuda:
        return ["precision=fp16: DeepSpeed's CPU accelerator has no fp16 (it supports fp32 and bf16); use "
                "precision=fp32, or bf16 on a CPU with AVX512-BF16/AMX"]
    return []


def _batch_errors(cfg: Any) -> list[str]:
    """`train.global_batch_size` against this launch's processes (`validate` has judged both values)."""
    micro = parse_batch_size(cfg.batch_size)
    try:
        world = max(1, world_size_from_env())
    except ValueError:
        world = 1
    problem = global_batch_problem(cfg.train.global_batch_size, micro or 1, world, auto=micro is None)
    return [problem] if problem else []


TRACKERS = ("mlflow", "wandb", "tensorboard")
"""The loggers that need a package of their own: llmexp's extra of the same name installs it."""


def _tracking_errors(cfg: Any) -> list[str]:
    """A tracker needs its package; `logger=mlflow`'s SQLite store's directory must exist (its file is created)."""
    name, errors = cfg.logger.name, []
    if name in TRACKERS and importlib.util.find_spec(name) is None:
        errors.append(f"logger={name} needs the {name} package: pip install 'llmexp[{name}]' (or pip install {name}), "
                      "or pick another logger")
    uri = cfg.logger.tracking_uri
    if name == "mlflow" and isinstance(uri, str) and uri.startswith("sqlite:///"):
        errors.extend(_sqlite_errors(uri, Path(uri.removeprefix("sqlite:///")).absolute()))
    return errors


SQLITE_HEADER = b"SQLite format 3\x00"


def _sqlite_errors(uri: str, db: Path) -> list[str]:
    """A SQLite store's file: in a directory that exists, and a SQLite database if it is there already."""
    fix = "point logger.tracking_uri at a .db file, or leave it null for a store in the run directory"
    if not db.parent.is_dir():
        return [f"logger.tracking_uri={uri}: no such directory {db.parent}; create it, or {fix}"]
    if not db.exists():
        return []  # MLflow creates it
    if not db.is_file():
        return [f"logger.tracking_uri={uri}: {db} is not a file; {fix}"]
    try:
        with open_regular(db) as f:
            head = f.read(len(SQLITE_HEADER))
    except OSError as err:
        return [f"logger.tracking_uri={uri}: cannot read {db} ({err.strerror}); {fix}"]
    if head and head != SQLITE_HEADER:
        return [f"logger.tracking_uri={uri}: {db} is not a SQLite database; {fix}"]
    return []
