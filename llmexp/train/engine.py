"""How this process carries out a step and saves its optimizer: plain PyTorch or DeepSpeed ZeRO,
behind one small interface that `Runtime` picks once at set-up.

The loop (`llmexp.train.train`) calls, for every optimizer step:

    engine.backward(loss)                          each micro-batch (fp16: through the loss scaler)
    engine.unscale_and_clip(model, optimizer, n)   the pre-clip global grad norm (inf/nan if non-finite)
    optimizer.step() / engine.scaler_step(...)     only when the anomaly policy says ok
    optimizer.zero_grad()

`PlainEngine` is one process or DDP through Accelerate, with torch's GradScaler in fp16.
`DeepSpeedEngine` is a ZeRO engine: it owns accumulation boundaries, clipping, fp16 loss scaling and
the step itself. DeepSpeed computes the gradient norm only inside its own step, so its
`unscale_and_clip` runs that step (clip, step, or skip when the norm is non-finite) and the policy
judges afterwards (`steps_in_clip`); the `optimizer.step()` and `zero_grad()` the loop then calls are
Accelerate's no-ops for a DeepSpeed optimizer.

For checkpoints each engine says how its weights and optimizer state are written and read back.
Under ZeRO, DeepSpeed's own `save_checkpoint`/`load_checkpoint` would read back with an unrestricted
`torch.load` (pickle). Instead each rank's optimizer shard (fp32 master partition, base optimizer
moments, loss scale) is converted to tensors and plain data and saved as `zero_rank<R>.pt` through
`checkpoint.serialize.save_state`, which loads back with `weights_only=True`; ZeRO's own
`load_state_dict` then restores it. Resuming a ZeRO checkpoint needs the same number of processes.

`FsdpEngine` (FSDP2, `llmexp.train.fsdp`) shards the model before the optimizer is built (`shard`)
and keeps Accelerate's wrappers out (`prepare`); its checkpoints go through DCP (`load_state`).
"""

from __future__ import annotations

import enum
import math
import os
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from llmexp.checkpoint import serialize
from llmexp.config.derived import BatchPlan
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
            raise _zero_mismatch(saved_with_zero=True)
        optimizer.load_state_dict(payload["optimizer"])

    def scaler_state(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_scaler_state(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)


def zero_world_mismatch(saved: int, now: int) -> UserError:
    return UserError(f"this DeepSpeed ZeRO checkpoint was saved by {saved} processes and cannot be resumed on {now}: "
                     "ZeRO partitions are per rank and DeepSpeed cannot repartition them (DeepSpeed #2898). Resume "
                     f"on {saved} processes, or start afresh with train.resume=never; for runs whose allocation may "
                     "change, train with fsdp=full_shard (deepspeed=none), whose DCP checkpoints reshard on load")


def _zero_mismatch(saved_with_zero: bool) -> UserError:
    saved = "with" if saved_with_zero else "without"
    return UserError(f"this checkpoint was saved {saved} DeepSpeed ZeRO and cannot be resumed "
                     f"{'without' if saved_with_zero else 'with'} it; resume with the deepspeed option it was saved "
                     "with, or start afresh with train.resume=never")


class DeepSpeedEngine(PlainEngine):
    """A DeepSpeed ZeRO engine, prepared by Accelerate (its config: `llmexp.train.distributed`)."""

    steps_in_clip = True
    reshardable = False  # ZeRO's partitions are per rank; DeepSpeed cannot repartition them (DeepSpeed #2898)

    def __init__(self, accelerator: Any, precision: str, plan: BatchPlan, stage: int) -> None:
        self.accelerator = accelerator
        self.scaler = None  # the engine owns fp16 loss scaling
        self.precision = precision
        self.plan = plan
        self.stage = stage
        self.params_partitioned = stage >= 3
        self.micro_steps_done = 0  # backward calls since the last step; the last is the accumulation boundary

    @property
    def _ds(self) -> Any:
        return self.accelerator.deepspeed_engine_wrapped.engine

    def backward(self, loss: torch.Tensor) -> None:
        """The loop's loss is already normalised by the global batch's target tokens, so the engine must
        not divide by the accumulation steps again; ZeRO reduces the gradients at the boundary."""
        self.micro_steps_done += 1
        self._ds.set_gradient_accumulation_boundary(self.micro_steps_done == self.plan.accum)
        self._ds.backward(loss, scale_wrt_gas=False)

    def unscale_and_clip(self, model: torch.nn.Module, optimizer: Any, max_norm: float) -> torch.Tensor:
        """The engine's step: norm, clip to `train.max_grad_norm` (its `gradient_clipping`), step and zero
        the grads, or skip when the norm is non-finite. Returns the pre-clip norm, inf on a skipped step."""
        if self.micro_steps_done != self.plan.accum:
            raise RuntimeError(f"a step after {self.micro_steps_done} micro-batches, expected {self.plan.accum}")
        self.micro_steps_done = 0
        self._ds.step()
        norm = self._ds.get_global_grad_norm()
        skipped = bool(getattr(self._ds.optimizer, "overflow", False)) or not self._ds.was_step_applied()
        return torch.tensor(math.inf if skipped or norm is None else float(norm))

    def loss_scale(self) -> float | None:
        return float(self._ds.optimizer.loss_scale) if self.precision == "fp16" else None

    # ------------------------------------------------------------------ checkpoints
    def lm(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.accelerator.unwrap_model(model).lm

    def full_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """ZeRO-3: the LM's weights gathered layer by layer (rank 0 gets the tensors)."""
        if self.stage < 3:
            return None
        state = self.accelerator.get_state_dict(model)  # Accelerate: _zero3_consolidated_16bit_state_dict
        return {k.removeprefix("lm."): v for k, v in state.items()} if self.accelerator.is_main_process else {}

    def optimizer_writer(self, optimizer: Any, run_dir: Path, step: int) -> OptimizerWriter:
        """Every rank writes its shard to a staging dir beside the checkpoints (collective); rank 0 then
        moves them into the checkpoint it publishes (same filesystem: renames)."""
        rank = self.accelerator.process_index
        staging = run_dir / ".zero_shards" / f"step_{step}"
        staging.mkdir(parents=True, exist_ok=True)
        final = staging / f"zero_rank{rank}.pt"
        tmp = final.with_name(final.name + ".tmp")
        serialize.save_state(tmp, _zero_shard_state(optimizer, self.plan.world))
        os.replace(tmp, final)
        self.accelerator.wait_for_everyone()

        def move_shards(checkpoint_tmp: Path) -> None:
            for shard in sorted(staging.glob("zero_rank*.pt")):
                os.replace(shard, checkpoint_tmp / shard.name)
            shutil.rmtree(staging, ignore_errors=True)

        return move_shards

    def load_weights(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        """ZeRO-3 gathers the partitioned parameters to fill them, and re-partitions from rank 0's values."""
        gathered: AbstractContextManager[Any] = nullcontext()
        if self.stage >= 3:
            import deepspeed

            gathered = deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0)
        with gathered:
            self.lm(model).load_state_dict(weights)

    def load_optimizer(self, optimizer: Any, payload: dict[str, Any]) -> None:
        """Restore this rank's shard into the ZeRO optimizer (fp32 master weights included)."""
        from deepspeed.checkpoint.constants import LOSS_SCALER

        shard = payload["zero"]
        if shard is None:
            raise _zero_mismatch(saved_with_zero=False)
        if shard["world_size"] != self.plan.world:
            raise zero_world_mismatch(shard["world_size"], self.plan.world)
        zero = inner_optimizer(optimizer)
        state = dict(shard["zero"])
        scaler = zero.loss_scaler
        for key, value in shard["loss_scaler"].items():
            setattr(scaler, key, value)
        state[LOSS_SCALER] = scaler
        rank = self.accelerator.process_index
        states = [state if r == rank else {} for r in range(self.plan.world)]
        zero.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)


def _plain(obj: Any) -> Any:
    """A ZeRO state dict as tensors and plain containers (what weights_only=True loads)."""
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {_plain(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj


def _zero_shard_state(optimizer: Any, world: int) -> dict[str, Any]:
    """This rank's ZeRO optimizer shard (fp32 master partition, base optimizer state, loss scale)."""
    from deepspeed.checkpoint.constants import LOSS_SCALER, PARAM_SLICE_MAPPINGS, UNIVERSAL_CHECKPOINT_INFO

    state = inner_optimizer(optimizer).state_dict()
    scaler = state.pop(LOSS_SCALER, None)
    state.pop(PARAM_SLICE_MAPPINGS, None)  # name -> fragment addresses: only for DeepSpeed's universal format
    state.pop(UNIVERSAL_CHECKPOINT_INFO, None)
    fields = {k: v for k, v in vars(scaler).items() if type(v) in (int, float, bool)} if scaler is not None else {}
    return {"zero": _plain(state), "loss_scaler": fields, "world_size": world}
