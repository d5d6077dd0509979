"""What every step engine offers the loop, the checkpoints and resume: the `Engine` base, whose defaults are
Accelerate's (one process or DDP) and a plain optimizer step; the plain engine (`plain.py`: one process or DDP),
DeepSpeed ZeRO (`deepspeed.py`) and FSDP2 (`fsdp.py`) override what they do otherwise. The order the loop calls
them in: `train.py`'s docstring (`steps_first`: `deepspeed.py`'s).
"""

from __future__ import annotations

import math
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from llmexp.errors import UserError
from llmexp.rundir.files import publish_dir, stage_dir

OptimizerWriter = Callable[[Path], None]
"""Writes the optimizer state into a checkpoint's temporary directory (rank 0, inside the save)."""


class Engine(ABC):
    """A step engine, as the loop (`train.py`), the checkpoints (`resume.py`) and `finish.py` use it."""

    accelerator: Any

    steps_first = False
    """`step` comes before `clip`: DeepSpeed measures the grad norm only inside its own step."""
    params_partitioned = False
    """No rank holds whole parameters (ZeRO-3): shapes cannot be checked before a load."""
    collective_forward = False
    """Every forward is collective (FSDP all-gathers): every rank must run as many."""
    sharded_checkpoints = False
    """Checkpoints hold a DCP `dcp/` directory (FSDP) instead of model and optimizer files."""
    zero_checkpoints = False
    """Checkpoints hold each rank's ZeRO shard (`zero_rank<R>.pt`: DeepSpeed) besides the weights (no resharding)."""

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as the optimizer must see it (FSDP shards it here); before the optimizer is built."""
        return model

    def prepare(self, model: torch.nn.Module, optimizer: Any) -> tuple[torch.nn.Module, Any]:
        """Model and optimizer ready for this process layout (DDP, the DeepSpeed engine, or as they are)."""
        return self.accelerator.prepare(model, optimizer)

    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[Any]:
        """Around every micro-batch but the last: no gradient reduction yet."""
        return self.accelerator.no_sync(model)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip(self, model: torch.nn.Module, optimizer: Any, max_norm: float, device: torch.device) -> torch.Tensor:
        """The gradients' pre-clip global norm (inf or nan when non-finite), after clipping them to `max_norm`
        (0: no clipping), as a 0-d tensor on `device` (the loss's: the loop stacks the two), wherever the
        gradients live (DeepSpeed's norm is a float, FSDP's CPU offload keeps it on the CPU)."""
        limit = max_norm if max_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], limit)
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).to(device)  # FSDP: a DTensor

    def step(self, optimizer: Any) -> bool:
        """The optimizer step; False when it was skipped (an fp16 overflow, a non-finite DeepSpeed norm)."""
        optimizer.step()
        return True

    def veto(self, optimizer: Any) -> None:
        """A step the anomaly policy vetoed (skip, rollback, diverged) after `clip`: no optimizer step is taken."""
        return None  # (nothing to undo; the plain engine's fp16 scaler has)

    def loss_scale(self) -> float | None:
        """fp16's current loss scale (train records log it), None without one."""
        return None

    def lm(self, model: torch.nn.Module) -> torch.nn.Module:
        """The Hugging Face model inside the engine's, compile's and the loss head's wrappers."""
        return getattr(model, "module", model).lm  # DistributedDataParallel's, DeepSpeed's engine

    def full_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Whole weights when they must be gathered for a checkpoint (collective: every rank calls); None: the
        checkpoint takes `checkpoint_weights`."""
        return None

    def final_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The weights `model/` gets (collective): those a checkpoint gathers, else None: the model's own."""
        return self.full_weights(model)

    def checkpoint_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The weights a checkpoint holds (with adapters: the trainable ones)."""
        return self.lm(model).state_dict()

    @abstractmethod
    def optimizer_writer(self, optimizer: Any, run_dir: Path, step: int) -> OptimizerWriter:
        """What writes the optimizer state (and the plain engine's fp16 loss scaler) into the checkpoint of `step`,
        on rank 0 inside the save; called on every rank: ZeRO and FSDP write their shards now, collectively."""

    def refuse_other_kind(self, path: Path, payload: dict[str, Any]) -> None:
        """A checkpoint (at `path`) another engine saved (FSDP's holds dcp/, ZeRO's each rank's zero_rank<R>.pt) cannot
        load into this one, which saves such checkpoints (`sharded_checkpoints`, `zero_checkpoints`) or neither."""
        dcp, zero = self.sharded_checkpoints, self.zero_checkpoints
        if payload["dcp"] is not None and not dcp:
            raise UserError(f"{path}: this checkpoint was saved with FSDP (it holds dcp/); resume it with the fsdp "
                            "option it was saved with (any of full_shard, shard_grad_op, hybrid_shard), or start "
                            "afresh with train.resume=never")
        if payload["dcp"] is None and dcp:
            raise UserError(f"{path}: this checkpoint was saved without FSDP (fsdp=none or deepspeed); resume it with "
                            "the options it was saved with, or start afresh with train.resume=never")
        if not dcp and (payload["zero"] is not None) != zero:
            saved, now = ("without", "with") if zero else ("with", "without")
            raise UserError(f"{path}: this checkpoint was saved {saved} DeepSpeed ZeRO and cannot be resumed {now} it; "
                            "resume with the deepspeed option it was saved with, or start afresh with "
                            "train.resume=never")

    @abstractmethod
    def load_state(self, model: torch.nn.Module, optimizer: Any, payload: dict[str, Any]) -> None:
        """Weights, optimizer state and loss scaler from a checked payload (`llmexp.train.resume`)."""

    def staged_writer(self, staging: Path, write: Callable[[Path], None], into: str = "") -> OptimizerWriter:
        """Every rank writes its shard into `staging`, a directory beside the checkpoints (collective); the writer
        returned moves them into the checkpoint rank 0 publishes (same filesystem: renames), as its directory
        `into`, or beside its other files."""
        if self.accelerator.is_main_process:
            stage_dir(staging)  # (a crashed save's leftover goes)
        self.accelerator.wait_for_everyone()
        write(staging)
        self.accelerator.wait_for_everyone()

        def move(checkpoint_tmp: Path) -> None:  # the checkpoint's staged dir fsyncs and publishes them
            if into:
                publish_dir(staging, checkpoint_tmp / into)
            else:
                for shard in sorted(staging.iterdir()):
                    os.replace(shard, checkpoint_tmp / shard.name)
            shutil.rmtree(staging.parent, ignore_errors=True)

        return move


def inner_optimizer(optimizer: Any) -> Any:
    """The optimizer inside Accelerate's wrapper (GradScaler and ZeRO need the real one)."""
    return getattr(optimizer, "optimizer", optimizer)
