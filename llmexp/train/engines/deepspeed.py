"""The DeepSpeed ZeRO engine, prepared by Accelerate (its config: `llmexp.train.distributed`). ZeRO owns
accumulation boundaries, clipping, fp16 loss scaling and the step itself; it computes the gradient norm only inside
that step, so the loop calls `step` first (`steps_first`), and the anomaly policy judges a step already taken.

Checkpoints never unpickle (why: docs/how-to/fsdp-and-deepspeed.md): each rank's optimizer shard is
`zero_rank<R>.pt` (`checkpoint.serialize`), restored by ZeRO's own `load_state_dict`. Resuming needs as many processes.
"""

from __future__ import annotations

import enum
import math
from pathlib import Path
from typing import Any

import torch

from llmexp.checkpoint import serialize
from llmexp.config.derived import BatchPlan
from llmexp.errors import UserError
from llmexp.train.engines.base import Engine, OptimizerWriter, inner_optimizer


def zero_world_mismatch(saved: int, now: int) -> UserError:
    return UserError(f"this DeepSpeed ZeRO checkpoint was saved by {saved} processes and cannot be resumed on {now}: "
                     "ZeRO partitions are per rank and DeepSpeed cannot repartition them (DeepSpeed #2898). Resume "
                     f"on {saved} processes, or start afresh with train.resume=never; for runs whose allocation may "
                     "change, train with fsdp=full_shard (deepspeed=none), whose DCP checkpoints reshard on load")


class DeepSpeedEngine(Engine):
    """ZeRO, prepared by Accelerate. Of the base's defaults: `shard` leaves the model whole (ZeRO partitions inside
    `prepare`: the DeepSpeed engine, its optimizer wrapped); `no_sync` is nothing under ZeRO-2/3 (`backward` marks
    the boundary), DDP's under ZeRO-1; a checkpoint holds the LM's whole state dict (adapters do not run under
    DeepSpeed: validation)."""

    steps_first = True
    zero_checkpoints = True  # (`zero_world_mismatch`)

    def __init__(self, accelerator: Any, precision: str, plan: BatchPlan, stage: int, cpu_lion: bool = False) -> None:
        self.accelerator = accelerator
        self.precision = precision
        self.plan = plan
        self.stage = stage
        self.cpu_lion = cpu_lion  # `distributed.builds_cpu_lion`
        self.params_partitioned = stage >= 3
        self.micro_steps_done = 0  # backward calls since the last step; the last is the accumulation boundary
        self.last_norm = math.inf  # the pre-clip norm of the last step (inf: DeepSpeed skipped it)

    def prepare(self, model: torch.nn.Module, optimizer: Any) -> tuple[torch.nn.Module, Any]:
        if self.cpu_lion:  # Lion's step on the CPU, with the groups' lrs, betas and weight decay
            from deepspeed.ops.lion import DeepSpeedCPULion

            optimizer = DeepSpeedCPULion(optimizer.param_groups, lr=optimizer.defaults["lr"],
                                         weight_decay=optimizer.defaults["weight_decay"])
        return self.accelerator.prepare(model, optimizer)

    @property
    def _ds(self) -> Any:
        return self.accelerator.deepspeed_engine_wrapped.engine

    def backward(self, loss: torch.Tensor) -> None:
        """The loop's loss is already normalised by the global batch's target tokens, so the engine must
        not divide by the accumulation steps again; ZeRO reduces the gradients at the boundary."""
        self.micro_steps_done += 1
        self._ds.set_gradient_accumulation_boundary(self.micro_steps_done == self.plan.accum)
        self._ds.backward(loss, scale_wrt_gas=False)

    def step(self, optimizer: Any) -> bool:
        """DeepSpeed's own step: the norm, clipping to `train.max_grad_norm` (its `gradient_clipping`), the
        step and zeroed grads, or a skipped step when the norm is non-finite (False). Before `clip`."""
        if self.micro_steps_done != self.plan.accum:
            raise RuntimeError(f"a step after {self.micro_steps_done} micro-batches, expected {self.plan.accum}")
        self.micro_steps_done = 0
        self._ds.step()
        norm = self._ds.get_global_grad_norm()
        skipped = bool(getattr(self._ds.optimizer, "overflow", False)) or not self._ds.was_step_applied()
        self.last_norm = math.inf if skipped or norm is None else float(norm)
        return not skipped

    def clip(self, model: torch.nn.Module, optimizer: Any, max_norm: float, device: torch.device) -> torch.Tensor:
        """The pre-clip norm of the step `step` just took (DeepSpeed clipped there); inf when it skipped it."""
        return torch.tensor(self.last_norm, device=device)

    def loss_scale(self) -> float | None:
        return float(self._ds.optimizer.loss_scale) if self.precision == "fp16" else None

    def full_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """ZeRO-3: the LM's weights gathered layer by layer (rank 0 gets the tensors)."""
        if self.stage < 3:
            return None
        state = self.accelerator.get_state_dict(model)  # Accelerate: _zero3_consolidated_16bit_state_dict
        return {k.removeprefix("lm."): v for k, v in state.items()} if self.accelerator.is_main_process else {}

    def optimizer_writer(self, optimizer: Any, run_dir: Path, step: int) -> OptimizerWriter:
        """Each rank's optimizer shard as `zero_rank<R>.pt`, beside the checkpoint's other files."""
        def write(staging: Path) -> None:
            serialize.save_state(staging / f"zero_rank{self.accelerator.process_index}.pt",
                                 _zero_shard_state(optimizer, self.plan.world))

        return self.staged_writer(run_dir / ".zero_shards" / f"step_{step}", write)

    def load_state(self, model: torch.nn.Module, optimizer: Any, payload: dict[str, Any]) -> None:
        """The weights (ZeRO-3 gathers the partitioned parameters to fill them, and re-partitions from rank 0's
        values), then this rank's shard into the ZeRO optimizer: fp32 master weights and the loss scale too."""
        import deepspeed
        from deepspeed.checkpoint.constants import LOSS_SCALER

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0, enabled=self.stage >= 3):
            self.lm(model).load_state_dict(payload["model"])
        shard = payload["zero"]
        if shard["world_size"] != self.plan.world:
            raise zero_world_mismatch(shard["world_size"], self.plan.world)
        zero = inner_optimizer(optimizer)
        for key, value in shard["loss_scaler"].items():
            setattr(zero.loss_scaler, key, value)
        state = {**shard["zero"], LOSS_SCALER: zero.loss_scaler}
        states = [state if r == self.accelerator.process_index else {} for r in range(self.plan.world)]
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
