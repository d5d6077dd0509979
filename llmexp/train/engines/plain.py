"""The plain engine: one process or DDP through Accelerate, with torch's GradScaler in fp16; and the small
interface every engine (`deepspeed.py`, `fsdp.py` beside this) offers the loop and the checkpoints.

The loop (`llmexp.train.train`) calls, for every optimizer step:

    engine.backward(loss)                          each micro-batch (fp16: through the loss scaler)
    engine.unscale_and_clip(model, optimizer, n)   the pre-clip global grad norm (inf/nan if non-finite)
    optimizer.step() / engine.scaler_step(...)     only when the anomaly policy says ok
    optimizer.zero_grad()

For checkpoints each engine says how its weights and optimizer state are written and read back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from llmexp.checkpoint import serialize
from llmexp.errors import UserError

OptimizerWriter = Callable[[Path], None]
"""Writes the optimizer state into a checkpoint's temporary directory (rank 0, inside the save)."""


def inner_optimizer(optimizer: Any) -> Any:
    """The optimizer inside Accelerate's wrapper (GradScaler and ZeRO need the real one)."""
    return getattr(optimizer, "optimizer", optimizer)


class PlainEngine:
    """One process or DDP through Accelerate; fp16 runs through torch's GradScaler."""

    steps_in_clip = False
    """True when `unscale_and_clip` has already applied the step (DeepSpeed)."""
    params_partitioned = False
    """True when no rank holds whole parameters (ZeRO-3): shapes cannot be checked before a load."""
    trainable_only = False
    """True with adapters: checkpoints hold only the trainable weights (`checkpoint_weights`)."""
    collective_forward = False
    """True when every forward is collective (FSDP all-gathers): every rank must run as many."""
    sharded_checkpoints = False
    """True when checkpoints hold a DCP `dcp/` directory (FSDP) instead of model and optimizer files."""
    reshardable = True
    """True when a checkpoint resumes on another number of processes (DDP: replicated state; FSDP: DCP)."""

    def __init__(self, accelerator: Any, precision: str, init_scale: float, growth_interval: int) -> None:
        self.accelerator = accelerator
        self.scaler = (torch.amp.GradScaler(accelerator.device.type, init_scale=init_scale,
                                            growth_interval=growth_interval) if precision == "fp16" else None)

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as the optimizer must see it (FSDP shards it here); before the optimizer is built."""
        return model

    def prepare(self, model: torch.nn.Module, optimizer: Any) -> tuple[torch.nn.Module, Any]:
        return self.accelerator.prepare(model, optimizer)  # DDP, or the DeepSpeed engine

    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[Any]:
        """Around every micro-batch but the last: no gradient reduction yet."""
        return self.accelerator.no_sync(model)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(self.scaler.scale(loss) if self.scaler is not None else loss)

    def unscale_and_clip(self, model: torch.nn.Module, optimizer: Any, max_norm: float) -> torch.Tensor:
        """Unscale fp16 grads, then clip to `max_norm` (0: no clipping); returns the pre-clip global norm."""
        if self.scaler is not None:
            self.scaler.unscale_(inner_optimizer(optimizer))
        limit = max_norm if max_norm > 0 else math.inf
        norm = self.accelerator.clip_grad_norm_(model.parameters(), limit)
        return norm if isinstance(norm, torch.Tensor) else torch.tensor(float(norm or 0.0))

    def scaler_step(self, optimizer: Any) -> bool:
        """fp16: the optimizer step through the scaler; False when it skipped an overflowed step."""
        assert self.scaler is not None
        scale = self.scaler.get_scale()
        self.scaler.step(inner_optimizer(optimizer))
        self.scaler.update()
        return self.scaler.get_scale() >= scale

    def loss_scale(self) -> float | None:
        return self.scaler.get_scale() if self.scaler is not None else None

    # ------------------------------------------------------------------ checkpoints
    def lm(self, model: torch.nn.Module) -> torch.nn.Module:
        """The Hugging Face model inside the compile / DDP / loss wrappers."""
        inner = getattr(model, "_orig_mod", model)  # torch.compile
        return getattr(inner, "module", inner).lm  # DistributedDataParallel

    def full_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Whole weights when they must be gathered first (collective: every rank calls); None: use `lm`'s."""
        return None

    def final_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The weights `model/` gets (collective); None: the model's own."""
        return self.full_weights(model)

    def checkpoint_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The weights a checkpoint holds: all of them, or with adapters only the trainable ones. The
        frozen base is rebuilt identically on resume (loaded from `model.name_or_path`, or initialised
        from the seed), so writing it again with every checkpoint would buy nothing."""
        state = self.lm(model).state_dict()
        if not self.trainable_only:
            return state
        names = {name for name, p in self.lm(model).named_parameters() if p.requires_grad}
        return {k: v for k, v in state.items() if k in names}

    def optimizer_writer(self, optimizer: Any, run_dir: Path, step: int) -> OptimizerWriter:
        return lambda tmp: serialize.save_state(tmp / "optimizer.pt", optimizer.state_dict())

    def load_state(self, model: torch.nn.Module, optimizer: Any, payload: dict[str, Any]) -> None:
        """Weights and optimizer state from a checked payload (`llmexp.train.resume`)."""
        if payload["dcp"] is not None:
            raise UserError("this checkpoint was saved with FSDP (it holds dcp/); resume it with the fsdp option it "
                            "was saved with (any of full_shard, shard_grad_op, hybrid_shard), or start afresh with "
                            "train.resume=never")
        self.load_weights(model, payload["model"])
        self.load_optimizer(optimizer, payload)

    def load_weights(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        # with adapters the frozen base is missing by design (`checkpoint_weights`); resume checked the rest
        self.lm(model).load_state_dict(weights, strict=not self.trainable_only)

    def load_optimizer(self, optimizer: Any, payload: dict[str, Any]) -> None:
        if payload["zero"] is not None:
            raise zero_mismatch(saved_with_zero=True)
        optimizer.load_state_dict(payload["optimizer"])

    def scaler_state(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_scaler_state(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)


def zero_mismatch(saved_with_zero: bool) -> UserError:
    saved = "with" if saved_with_zero else "without"
    return UserError(f"this checkpoint was saved {saved} DeepSpeed ZeRO and cannot be resumed "
                     f"{'without' if saved_with_zero else 'with'} it; resume with the deepspeed option it was saved "
                     "with, or start afresh with train.resume=never")


