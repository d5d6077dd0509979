"""Checkpoints under DeepSpeed ZeRO, without pickle.

DeepSpeed's own `save_checkpoint`/`load_checkpoint` write with torch.save and read back with
an unrestricted `torch.load` (weights-only mode off), which runs pickle code. Instead, each rank's ZeRO optimizer shard
(its fp32 master partition, the base optimizer's moments, the loss scale) is converted to tensors
and plain data and saved with `ckpt_state.save_state` as `zero_rank<R>.pt`, so it loads back with
`weights_only=True`; ZeRO's own `load_state_dict` then restores it. The weights go to
`model.safetensors` as usual (gathered from every rank under ZeRO-3). Resuming needs the same
number of processes (each shard is one rank's partition).
"""

from __future__ import annotations

import enum
import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmexp.errors import UserError

if TYPE_CHECKING:
    import torch

    from llmexp.runtime import Runtime


def full_lm_state(rt: Runtime, model: Any) -> dict[str, torch.Tensor] | None:
    """ZeRO-3: the LM's full weights gathered layer by layer (collective: every rank calls it;
    rank 0 gets the tensors). None when the module holds full weights (ZeRO 1-2): use its own."""
    if not rt.deepspeed or rt.cfg.deepspeed.stage < 3:
        return None
    state = rt.accelerator.get_state_dict(model)  # Accelerate: _zero3_consolidated_16bit_state_dict
    return {k.removeprefix("lm."): v for k, v in state.items()} if rt.is_main else {}


def gathered_for_load(rt: Runtime, model: Any) -> AbstractContextManager[Any]:
    """ZeRO-3: gather the partitioned parameters so `load_state_dict` can fill them, and
    re-partition (from rank 0's values) on exit. A no-op otherwise."""
    if not rt.deepspeed or rt.cfg.deepspeed.stage < 3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0)


def zero_shard_filename(rank: int) -> str:
    return f"zero_rank{rank}.pt"


def _plain(obj: Any) -> Any:
    """A ZeRO state dict as tensors and plain containers (what weights_only=True loads)."""
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {_plain(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj


def _scaler_fields(scaler: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(scaler).items() if type(v) in (int, float, bool)}


def zero_shard_state(optimizer: Any, world: int) -> dict[str, Any]:
    """This rank's ZeRO optimizer shard (fp32 master partition, base optimizer state, loss scale)."""
    from deepspeed.checkpoint.constants import LOSS_SCALER, PARAM_SLICE_MAPPINGS, UNIVERSAL_CHECKPOINT_INFO

    zero = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper -> DeepSpeed's ZeRO optimizer
    state = zero.state_dict()
    scaler = state.pop(LOSS_SCALER, None)
    state.pop(PARAM_SLICE_MAPPINGS, None)  # name -> fragment addresses: only for DeepSpeed's universal format
    state.pop(UNIVERSAL_CHECKPOINT_INFO, None)
    return {"zero": _plain(state), "loss_scaler": _scaler_fields(scaler) if scaler is not None else {},
            "world_size": world}


def stage_zero_shard(rt: Runtime, optimizer: Any, step: int) -> Path:
    """Every rank writes its ZeRO shard to a staging dir beside the checkpoints (collective);
    rank 0 then moves the shards into the checkpoint it publishes (`move_zero_shards`)."""
    from llmexp import checkpoint as ckpt

    staging = rt.run_dir / ".zero_shards" / f"step_{step}"
    staging.mkdir(parents=True, exist_ok=True)
    final = staging / zero_shard_filename(rt.rank)
    tmp = final.with_name(final.name + ".tmp")
    ckpt.save_state(tmp, zero_shard_state(optimizer, rt.plan.world))
    os.replace(tmp, final)
    rt.accelerator.wait_for_everyone()
    return staging


def move_zero_shards(staging: Path, checkpoint_tmp: Path) -> None:
    """Rank 0, inside the checkpoint's write: move every rank's shard in (same filesystem: renames)."""
    import shutil

    for shard in sorted(staging.glob("zero_rank*.pt")):
        os.replace(shard, checkpoint_tmp / shard.name)
    shutil.rmtree(staging, ignore_errors=True)


def load_zero_shard(rt: Runtime, optimizer: Any, payload: dict[str, Any]) -> None:
    """Restore this rank's shard into the engine's ZeRO optimizer (fp32 master weights included)."""
    from deepspeed.checkpoint.constants import LOSS_SCALER

    shard = payload.get("zero")
    if not rt.deepspeed or shard is None:
        saved, now = ("with" if shard is not None else "without"), rt.cfg.deepspeed.name
        raise UserError(f"this checkpoint was saved {saved} DeepSpeed ZeRO and cannot be resumed with "
                        f"deepspeed={now}; resume with the deepspeed option it was saved with, or start afresh "
                        "with train.resume=never")
    if shard["world_size"] != rt.plan.world:
        raise UserError(f"this DeepSpeed checkpoint was saved by {shard['world_size']} processes; resume it with "
                        f"the same number (got {rt.plan.world}), or start afresh with train.resume=never")
    zero = getattr(optimizer, "optimizer", optimizer)
    state = dict(shard["zero"])
    scaler = zero.loss_scaler
    for key, value in shard["loss_scaler"].items():
        setattr(scaler, key, value)
    state[LOSS_SCALER] = scaler
    states = [state if r == rt.rank else {} for r in range(rt.plan.world)]
    zero.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)
