"""Processes and engines: the Accelerate settings derived from the config, and DeepSpeed (the CLI's relaunch of a
launcher's workers: `llmexp.cli.relaunch`).

Multi-process runs use torch.distributed through Accelerate (DDP; gloo on CPU, NCCL on GPU). DeepSpeed ZeRO runs
through Accelerate's `DeepSpeedPlugin` with a config derived here (`deepspeed_config`; why and from what:
docs/how-to/fsdp-and-deepspeed.md, "DeepSpeed ZeRO"); the step and checkpoints under ZeRO: `engines/deepspeed.py`.
"""

from __future__ import annotations

import math
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DeepSpeedPlugin, DistributedType
from omegaconf import DictConfig

from llmexp.config.derived import BatchPlan
from llmexp.errors import UserError
from llmexp.machine.environment import deepspeed_errors

TORCH_EXTENSIONS_DIR = "~/.cache/llmexp/torch_extensions"
"""Where DeepSpeed's JIT-compiled CPU ops (cpu_adam, cpu_lion) are cached, unless the user set
TORCH_EXTENSIONS_DIR: the first build takes minutes, later runs load the .so in a second."""


def accelerator_kwargs(cfg: DictConfig, plan: BatchPlan | None, precision: str) -> dict[str, Any]:
    """Arguments for `accelerate.Accelerator`. Mixed precision is left to the trainer (its own autocast and fp16
    scaler): Accelerate's wrapper would cast the whole logits tensor to fp32 after every forward. Under DeepSpeed
    the engine owns precision and the batch plan (`plan`, needed only then), so the plugin carries them."""
    check_launch_env(cfg, dict(os.environ))
    kwargs: dict[str, Any] = {"cpu": not torch.cuda.is_available(), "mixed_precision": "no"}
    if kwargs["cpu"]:  # DeepSpeed (imported by Accelerate and transformers when installed) would guess the
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # same, with a "Setting accelerator to CPU" warning
    if cfg.deepspeed.stage > 0:
        kwargs["cpu"] = False  # cpu=True makes Accelerate drop the DeepSpeed plugin silently; DeepSpeed finds the CPU
        assert plan is not None, "DeepSpeed's config needs the batch plan"
        if errors := deepspeed_errors(cfg, torch.cuda.is_available()):  # check_environment guessed without torch
            raise UserError("cannot run this config here:\n  " + "\n  ".join(errors))
        # The launcher's DeepSpeed fields were checked to agree (check_launch_env); our config replaces them.
        os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser(TORCH_EXTENSIONS_DIR))
        single_process_env()
        ds_config = deepspeed_config(cfg, micro=plan.micro, accum=plan.accum, world=plan.world,
                                     precision=precision, cuda=torch.cuda.is_available())
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=ds_config)
    return kwargs


def check_launch_env(cfg: DictConfig, env: dict[str, str]) -> None:
    """`accelerate launch` with a DeepSpeed config file must agree with the `deepspeed` group: llmexp
    derives the DeepSpeed config from its own config, and a launcher that says otherwise is a mistake."""
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        return
    ds = cfg.deepspeed
    launched = {"stage": env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"),
                "offload_optimizer": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
                "offload_param": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE")}
    clashes = [f"{k}: launcher {v}, deepspeed.{k}={ds[k]}" for k, v in launched.items() if v not in (None, str(ds[k]))]
    if ds.stage == 0 or clashes:
        raise UserError("accelerate launch was given a DeepSpeed config that disagrees with llmexp's deepspeed group ("
                        + ("; ".join(clashes) or "deepspeed=none") + "). llmexp builds the DeepSpeed config itself: "
                        "pick the matching option, e.g. deepspeed=zero2_offload with "
                        "launch/accelerate/deepspeed_zero2_offload.yaml, or launch with launch/accelerate/8gpu.yaml")
    if env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") not in (None, "", "none", "None"):
        raise UserError("accelerate launch was given a deepspeed_config_file; llmexp derives the DeepSpeed config "
                        "from its own config (deepspeed=..., batch_size, train.*, precision). Remove "
                        "deepspeed_config_file from the accelerate config.")


def single_process_env() -> None:
    """DeepSpeed initialises torch.distributed even for one process and, without a launcher's
    variables, goes looking for MPI; give a plain `python -m llmexp` a one-rank world instead."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def check_engine(accelerator: Any) -> None:
    """Fail loudly if Accelerate did not enable the DeepSpeed plugin it was given, and repair the
    process layout Accelerate 1.15 leaves at 1 process / rank 0 for DeepSpeed on CPU (it reads
    it from the device's branch, which CPU lacks), although torch.distributed holds N ranks."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise RuntimeError(f"deepspeed was configured but Accelerate runs {accelerator.distributed_type}; "
                           "check ACCELERATE_USE_CPU / `accelerate launch --cpu`, which turn DeepSpeed off")
    if dist.is_initialized() and accelerator.num_processes != dist.get_world_size():
        for state in (PartialState(), AcceleratorState()):
            state.num_processes, state.process_index = dist.get_world_size(), dist.get_rank()
            state.local_process_index = int(os.environ.get("LOCAL_RANK", "0"))


def builds_cpu_lion(cfg: DictConfig) -> bool:
    """optimizer=lion under DeepSpeed's optimizer offload: the engine builds DeepSpeedCPULion itself. Accelerate 1.16
    maps bitsandbytes' Lion to it too, but passes it Adam's `adamw_mode`, which it refuses (a TypeError as the run
    started); told not to force a CPU optimizer of its own (`zero_force_ds_cpu_optimizer`), Accelerate hands the
    engine's to DeepSpeed as it is, which accepts it under offload."""
    return cfg.deepspeed.offload_optimizer != "none" and cfg.optimizer.name == "lion"


def deepspeed_config(cfg: DictConfig, *, micro: int, accum: int, world: int, precision: str,
                     cuda: bool) -> dict[str, Any]:
    """The DeepSpeed config, every value derived from the composed config (no `auto`)."""
    ds = cfg.deepspeed
    zero: dict[str, Any] = {"stage": ds.stage, "contiguous_gradients": True, "overlap_comm": cuda}
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": ds.offload_optimizer, "pin_memory": cuda}
    if ds.stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True  # model/ and checkpoints need full weights
        if ds.offload_param != "none":
            zero["offload_param"] = {"device": ds.offload_param, "pin_memory": cuda}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world,
        "gradient_clipping": float(cfg.train.max_grad_norm),
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16", "check_grad_overflow": True},
        "fp16": {"enabled": precision == "fp16"},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": not builds_cpu_lion(cfg),
        "steps_per_print": 2**31 - 1,  # the loop logs; keep DeepSpeed's own step lines out of the console
        "wall_clock_breakdown": False,
    }
    if precision == "fp16":  # the same dynamic loss scaling the non-DeepSpeed path gets from GradScaler
        config["fp16"].update({"loss_scale": 0, "initial_scale_power": int(math.log2(cfg.precision.init_scale)),
                               "loss_scale_window": cfg.precision.growth_interval, "hysteresis": 1,
                               "min_loss_scale": 1})
    return config
