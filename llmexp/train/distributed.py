"""Processes and engines: the Accelerate settings derived from the config, and DeepSpeed.

Multi-process runs use torch.distributed through Accelerate (DDP; gloo on CPU, NCCL on GPU).
DeepSpeed ZeRO runs through Accelerate's `DeepSpeedPlugin`, with a DeepSpeed config derived
here from the composed config, so that micro-batch, accumulation, clipping and precision can
never disagree with what the loop does:

- micro-batch = `batch_size`, accumulation = the loop's (`train.gradient_accumulation_steps`
  or the one `train.global_batch_size` derives), train_batch_size = their product x world;
- the loop normalises each micro-batch's loss by the global batch's target-token count, so the
  engine must not divide by the accumulation steps again: `backward(scale_wrt_gas=False)`;
- the engine steps, clips (`gradient_clipping = train.max_grad_norm`) and skips non-finite
  steps itself (`bf16.check_grad_overflow`), and in fp16 owns the dynamic loss scale (the
  loop's own GradScaler is off).

The step and checkpoints under ZeRO: `llmexp.train.engines.deepspeed`.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from typing import Any

from omegaconf import DictConfig

from llmexp.config.derived import BatchPlan
from llmexp.config.environment import deepspeed_errors
from llmexp.errors import EXIT_ERROR, UserError
from llmexp.monitor.console import silence_dead_stdio
from llmexp.train.preemption import say

TORCH_EXTENSIONS_DIR = "~/.cache/llmexp/torch_extensions"
"""Where DeepSpeed's JIT-compiled CPU ops (cpu_adam, cpu_lion) are cached, unless the user set
TORCH_EXTENSIONS_DIR: the first build takes minutes, later runs load the .so in a second."""

def accelerator_kwargs(cfg: DictConfig, plan: BatchPlan | None, precision: str) -> dict[str, Any]:
    """Arguments for `accelerate.Accelerator`.

    Mixed precision is left to the trainer (its own autocast and fp16 scaler): Accelerate's
    wrapper would cast the whole logits tensor to fp32 after every forward. Under DeepSpeed
    the engine owns precision and the batch plan, so the plugin carries them (see `deepspeed_config`;
    `plan` is needed only then).
    """
    import torch

    check_launch_env(cfg, dict(os.environ))
    kwargs: dict[str, Any] = {"cpu": not torch.cuda.is_available(), "mixed_precision": "no"}
    if kwargs["cpu"]:  # DeepSpeed (imported by Accelerate and transformers when installed) would guess the
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # same, with a "Setting accelerator to CPU" warning
    if cfg.deepspeed.stage > 0:
        kwargs["cpu"] = False  # cpu=True makes Accelerate drop the DeepSpeed plugin silently; DeepSpeed finds the CPU
        from accelerate.utils import DeepSpeedPlugin

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
    ours = {"stage": str(ds.stage), "offload_optimizer": ds.offload_optimizer, "offload_param": ds.offload_param}
    clashes = [f"{k}: launcher {v}, deepspeed.{k}={ours[k]}" for k, v in launched.items()
               if v is not None and v != ours[k]]
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
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def check_engine(accelerator: Any) -> None:
    """Fail loudly if Accelerate did not enable the DeepSpeed plugin it was given, and repair the
    process layout Accelerate 1.15 leaves at 1 process / rank 0 for DeepSpeed on CPU (it reads
    it from the device's branch, which CPU lacks), although torch.distributed holds N ranks."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise RuntimeError(f"deepspeed was configured but Accelerate runs {accelerator.distributed_type}; "
                           "check ACCELERATE_USE_CPU / `accelerate launch --cpu`, which turn DeepSpeed off")
    if dist.is_initialized() and accelerator.num_processes != dist.get_world_size():
        for state in (PartialState(), AcceleratorState()):
            state.num_processes, state.process_index = dist.get_world_size(), dist.get_rank()
            state.local_process_index = int(os.environ.get("LOCAL_RANK", "0"))


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
        "steps_per_print": 2**31 - 1,  # the loop logs; keep DeepSpeed's own step lines out of the console
        "wall_clock_breakdown": False,
    }
    if precision == "fp16":  # the same dynamic loss scaling the non-DeepSpeed path gets from GradScaler
        config["fp16"].update({"loss_scale": 0, "initial_scale_power": int(math.log2(cfg.precision.init_scale)),
                               "loss_scale_window": cfg.precision.growth_interval, "hysteresis": 1,
                               "min_loss_scale": 1})
    return config


# ----------------------------------------------------------------------------- launching


def relaunch_argv(parent_cmdline: list[str], env: dict[str, str], argv: list[str]) -> list[str] | None:
    """The torchrun command that runs `argv` on N processes, when this process was started by
    `accelerate launch --cpu --num_processes N` (N > 1) as a single process.

    Accelerate 1.15 starts CPU multi-process jobs only through mpirun (`--mpirun_hostfile`);
    without it, `--cpu --num_processes 2` silently runs ONE process. We start the N ranks with
    torch.distributed.run instead (gloo), which is what `--multi_gpu` does on a GPU machine.
    """
    if "WORLD_SIZE" in env or env.get("ACCELERATE_USE_CPU", "").lower() not in ("true", "1"):
        return None
    try:
        at = next(i for i, a in enumerate(parent_cmdline) if a in ("launch", "accelerate.commands.launch"))
    except StopIteration:
        return None
    num_processes = _flag_value(parent_cmdline[at + 1:], "--num_processes")
    if num_processes is None or num_processes <= 1:
        return None
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_processes}",
            *argv]


def _flag_value(args: list[str], flag: str) -> int | None:
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return int(arg.split("=", 1)[1])
        if arg == flag and i + 1 < len(args):
            return int(args[i + 1])
        if not arg.startswith("-"):  # the training script or module: the launcher's flags end here
            return None
    return None


def maybe_relaunch() -> None:
    """Called first by the CLI: a worker of a multi-process launch ends with its launcher (`watch_launcher`),
    and `accelerate launch --cpu --num_processes N` becomes N ranks (this process becomes their torchrun, and
    ends with accelerate: `end_with_parent`)."""
    if "LOCAL_RANK" in os.environ:  # torchrun, accelerate and deepspeed set it in every worker they start
        watch_launcher()
        return
    if "WORLD_SIZE" in os.environ or not os.environ.get("ACCELERATE_USE_CPU"):
        return
    import psutil

    parent = psutil.Process(os.getppid()).cmdline()
    argv = relaunch_argv(parent, dict(os.environ), ["-m", "llmexp", *sys.argv[1:]])
    if argv is not None:
        end_with_parent()
        os.execv(sys.executable, argv)


# ----------------------------------------------------------------------------- ending with the launcher

ORPHAN_GRACE_S = 120.0
"""How long a worker whose launcher died may take to checkpoint and stop before it exits regardless (a
collective with a dead peer can block for the process group's timeout, 30 minutes by default)."""


def watch_launcher(poll_s: float = 1.0, grace_s: float = ORPHAN_GRACE_S) -> None:
    """End this worker when the launcher that started it dies (kill -9, a closed terminal): torchrun and
    accelerate start each worker in a session of its own, so no signal reaches it, and it would train on as an
    orphan, holding the run directory's lock and its device.

    A daemon thread polls the parent pid. When it changes (the worker was re-parented to init or a subreaper),
    the worker sends itself SIGTERM, which stops the run as a preemption does (a checkpoint at the next step
    boundary, status `preempted`: the same command resumes it), and exits after `grace_s` if that has not
    happened. A thread rather than `prctl(PR_SET_DEATHSIG)`: the kernel sends that signal when the parent
    *thread* that forked the worker exits, not the process (a launcher may fork from a helper thread), it
    exists on Linux only, and it has no second step for a checkpoint that hangs on a dead peer; the thread
    watches the process, runs anywhere, and escalates."""
    import threading

    parent = os.getppid()
    if parent == 1:  # started by init itself: no launcher to watch
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        silence_dead_stdio()  # the launcher may have been the reader of our stderr
        say(f"llmexp: the launcher (pid {parent}) is gone: stopping this worker (pid {os.getpid()}) "
            "at the next step boundary, with a checkpoint\n")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        say(f"llmexp: worker {os.getpid()} did not stop within {grace_s:.0f} s of its launcher's end; exiting now\n")
        os._exit(EXIT_ERROR)

    threading.Thread(target=watch, name="llmexp-launcher-watch", daemon=True).start()


PR_SET_DEATHSIG = 1
"""prctl(2): the signal this process gets when its parent thread exits."""


def end_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux; elsewhere nothing). Used before
    the relaunch's `execv` into torchrun: after it, no llmexp code runs in this process to watch, and the
    setting survives the exec. Its parent is `accelerate launch`, whose main thread started it and waits for
    it, so the thread's end is the process's. torchrun, on SIGTERM, stops its workers with SIGTERM in turn."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DEATHSIG, int(sig), 0, 0, 0) != 0:
        return  # best effort: the workers still watch their own launcher
    if os.getppid() != parent:  # the parent died before the setting took hold: nobody is left to serve
        os._exit(EXIT_ERROR)
