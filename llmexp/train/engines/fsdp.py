"""The FSDP2 step engine: every decoder layer and the model root sharded with torch's `fully_shard`,
checkpoints through torch.distributed.checkpoint (DCP), which reshards on load. The options, their mixed
precision and the checkpoints' guarantees: docs/how-to/fsdp-and-deepspeed.md, which says why not Accelerate's
FSDP plugin (dropped on CPU and on one process). One code path, sharded the same way on one process, on CPU with
gloo (the tests) and on GPUs, is worth more than the plugin's wrapping.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmexp.checkpoint import dcp
from llmexp.checkpoint.serialize import CorruptCheckpoint
from llmexp.config.derived import BatchPlan
from llmexp.errors import UserError
from llmexp.model.build import decoder_blocks
from llmexp.train.engines.base import Engine, OptimizerWriter

OFFLOAD_BACKEND = "cuda:nccl,cpu:gloo"
"""fsdp.cpu_offload keeps the gradients, and so the grad norm clip reduces, on the CPU, which NCCL cannot carry:
gloo takes the CPU tensors (torchtitan opens the same group for its CPU offload)."""


def backend(cpu_offload: bool) -> str:
    if not torch.cuda.is_available():
        return "gloo"
    return OFFLOAD_BACKEND if cpu_offload else "nccl"


def ensure_process_group(cpu_offload: bool = False) -> None:
    """fully_shard needs a process group even for one process: give a plain `python -m llmexp` one."""
    from llmexp.train.distributed import single_process_env

    if not dist.is_initialized():
        single_process_env()
        dist.init_process_group(backend(cpu_offload))


class FsdpEngine(Engine):
    """FSDP2 through torch's `fully_shard`; the optimizer is a plain torch optimizer over DTensors, stepped as
    the base steps it (fp16, which would need a sharded loss scaler, is refused by validation)."""

    # params_partitioned stays False: DCP checks every shard's shape itself on load
    collective_forward = True
    sharded_checkpoints = True

    def __init__(self, accelerator: Any, precision: str, plan: BatchPlan, strategy: str, cpu_offload: bool) -> None:
        self.accelerator = accelerator
        self.precision = precision
        self.plan = plan
        self.strategy = strategy
        self.cpu_offload = cpu_offload
        self.model: torch.nn.Module | None = None  # the sharded model, for the checkpoint writer

    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        names, shape = ("shard",), (self.plan.world,)
        if self.strategy == "hybrid_shard":
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.plan.world))
            if self.plan.world % per_node:
                raise UserError(f"fsdp=hybrid_shard shards within a node: {self.plan.world} processes do not split "
                                f"into nodes of LOCAL_WORLD_SIZE={per_node}; use fsdp=full_shard")
            names, shape = ("replicate", "shard"), (self.plan.world // per_node, per_node)
        # Accelerate opened an NCCL-only default group under torchrun: the mesh's own groups carry CPU tensors too
        override = {n: OFFLOAD_BACKEND for n in names} if backend(self.cpu_offload) == OFFLOAD_BACKEND else None
        return init_device_mesh(self.accelerator.device.type, shape, mesh_dim_names=names, backend_override=override)

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """fully_shard each decoder layer (transformers' `_no_split_modules`), then the root."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        ensure_process_group(self.cpu_offload)
        lm = model.lm  # type: ignore[attr-defined]  # CausalLMLoss
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if self.precision == "bf16" else MixedPrecisionPolicy())
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.cpu_offload else OffloadPolicy()
        kwargs = {"mesh": self._mesh(), "mp_policy": mp, "offload_policy": offload,
                  "reshard_after_forward": self.strategy != "shard_grad_op"}
        layers = decoder_blocks(lm)
        if not layers:
            raise UserError(f"fsdp={self.strategy}: found no decoder layers to shard in {type(lm).__name__} "
                            "(transformers' _no_split_modules is empty); use fsdp=none")
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        self.model = model
        return model

    def prepare(self, model: torch.nn.Module, optimizer: Any) -> tuple[torch.nn.Module, Any]:
        return model, optimizer  # already sharded; Accelerate's DDP wrapper must stay out

    @contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Accumulate unsharded gradients; the last micro-batch reduce-scatters them once."""
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def checkpoint_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {}  # the weights are in dcp/, written by `optimizer_writer`

    def final_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The full weights gathered to rank 0 on the CPU (collective); {} on the other ranks."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k.removeprefix("lm."): v for k, v in state.items()}

    def _state(self, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        assert self.model is not None, "shard() builds the model first"
        model_state, optim_state = get_state_dict(self.model, optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def optimizer_writer(self, optimizer: Any, run_dir: Path, step: int) -> OptimizerWriter:
        from torch.distributed.checkpoint import save as dcp_save  # collective: every rank writes its shard

        return self.staged_writer(run_dir / ".fsdp_dcp" / f"step_{step}",
                                  lambda staging: dcp_save(self._state(optimizer), checkpoint_id=str(staging)),
                                  into=dcp.DIR_NAME)

    def load_state(self, model: torch.nn.Module, optimizer: Any, payload: dict[str, Any]) -> None:
        """dcp.load into this run's shards, whatever the number of processes that saved them."""
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state(optimizer)
        try:
            dcp.load(state, payload["dcp"])
        except CheckpointException as err:  # a BaseException in torch: turn it into the user's error
            refused = [e[0] for e in err.failures.values() if isinstance(e[0], CorruptCheckpoint)]
            raise refused[0] if refused else RuntimeError(str(err).splitlines()[-1][:300]) from None
        set_state_dict(self.model or model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
