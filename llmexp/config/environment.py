"""What depends on this machine and launch, checked after `validate` and before anything loads: the world
size against the global batch, files and directories that must exist.

It runs in the CLI before Hydra runs, and again in `train.task.run_guarded` for sweep jobs. `validate`
stays a pure function of the config, so a config validates on any machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmexp.config.derived import parse_batch_size, world_size_from_env
from llmexp.config.paths import directory_errors, path_errors
from llmexp.errors import UserError


def check_environment(cfg: Any) -> None:
    """After `validate`, before anything loads: what depends on this machine and launch (the world size,
    every file and directory the config names: `paths.path_errors`). Raises one UserError listing every problem."""
    errors = [*_batch_errors(cfg), *path_errors(cfg)]
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


def _batch_errors(cfg: Any) -> list[str]:
    """`train.global_batch_size` must split into batch_size x processes x accumulation steps
    (with batch_size=auto the probe picks a divisor, so the processes alone must divide it)."""
    global_batch = cfg.train.global_batch_size
    try:
        micro = parse_batch_size(cfg.batch_size) or 1
    except ValueError:
        return []  # validation names the bad value
    try:
        world = max(1, world_size_from_env())
    except ValueError:
        world = 1
    if global_batch is None or global_batch <= 0 or micro <= 0 or global_batch % (micro * world) == 0:
        return []
    per_step = micro * world
    nearest = per_step * max(1, round(global_batch / per_step))
    if parse_batch_size(cfg.batch_size) is None:
        return [f"train.global_batch_size={global_batch} is not a multiple of the {world} processes, so no "
                f"micro-batch for batch_size=auto divides it; pick a multiple of {world} (e.g. {nearest})"]
    return [f"train.global_batch_size={global_batch} is not a multiple of batch_size x processes = "
            f"{micro} x {world} = {per_step}; pick a multiple of {per_step} (e.g. {nearest})"]
