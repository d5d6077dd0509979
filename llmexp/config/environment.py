"""What depends on this machine and launch, checked after `validate` and before anything loads: the world
size against the global batch, files and directories that must exist.

It runs in the CLI before Hydra runs, and again in `train.task.run_guarded` for sweep jobs. `validate`
stays a pure function of the config, so a config validates on any machine.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

from llmexp.config.derived import parse_batch_size, world_size_from_env
from llmexp.errors import UserError


def check_environment(cfg: Any) -> None:
    """After `validate`, before anything loads: what depends on this machine and launch (bf16 support,
    the world size, files that must exist). Raises one UserError listing every problem."""
    errors = [*_batch_errors(cfg), *_file_errors(cfg)]
    if errors:
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


def _file_errors(cfg: Any) -> list[str]:
    d, errors = cfg.data, []
    for key in ("train_file", "eval_file"):
        spec = d.get(key) if hasattr(d, "get") else getattr(d, key)
        if d.name in ("json", "text") and spec and not _matches(str(spec), allow_dir_or_glob=d.name == "text"):
            what = "file" if d.name == "json" else "file, directory or glob match"
            errors.append(f"data.{key}={spec}: no such {what} (looked at {Path(str(spec)).expanduser().resolve()}); "
                          f"fix the path or set data.{key}=path/to/{'train' if key == 'train_file' else 'eval'}.jsonl")
    for key, value in (("model.name_or_path", cfg.model.name_or_path), ("data.tokenizer", d.tokenizer)):
        if value and str(value).startswith((".", "/", "~")) and not Path(str(value)).expanduser().is_dir():
            errors.append(f"{key}={value}: no such directory; point it at a save_pretrained directory or a hub id")
    errors += _task_file_errors(cfg)
    resume = str(cfg.train.resume)
    if resume not in ("auto", "never") and resume and not Path(resume).expanduser().is_dir():
        errors.append(f"train.resume={resume}: no such checkpoint directory; use train.resume=auto, never, "
                      "or a checkpoints/step_<N> directory")
    return errors


def _task_file_errors(cfg: Any) -> list[str]:
    """The eval tasks' files and the harness's task directory exist (their content is read before the data)."""
    ev, errors = cfg.eval, []
    for kind in ("multiple_choice", "generate"):
        for name, task in ev[kind].items():
            if task.file and not Path(str(task.file)).expanduser().is_file():
                errors.append(f"eval.{kind}.{name}.file={task.file}: no such file (looked at "
                              f"{Path(str(task.file)).expanduser().resolve()}); fix the path")
    path = ev.lm_eval.include_path
    if path and not Path(str(path)).expanduser().is_dir():
        errors.append(f"eval.lm_eval.include_path={path}: no such directory; point it at a directory of task YAMLs")
    return errors


def _matches(spec: str, allow_dir_or_glob: bool) -> bool:
    path = Path(spec).expanduser()
    if path.is_file():
        return True
    if not allow_dir_or_glob:
        return False
    return path.is_dir() or any(Path(p).is_file() for p in glob.iglob(os.path.expanduser(spec), recursive=True))
