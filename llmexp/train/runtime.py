"""One process of a run (`Runtime`); the run's set-up, once the data is known, is `llmexp.train.setup`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from llmexp.config.derived import make_plan, use_shared_compile_cache
from llmexp.config.derived import world_size_from_env as world_size
from llmexp.data.cache import save_cache
from llmexp.machine.precision import precision_on
from llmexp.model import build
from llmexp.model.bf16_emulation import Bf16Emulation, settle_on_cpu
from llmexp.monitor.console import quiet_console
from llmexp.monitor.logger import MetricsLogger
from llmexp.monitor.sinks import make_sinks
from llmexp.monitor.throughput import load_ceilings, measure_ceiling
from llmexp.train.distributed import accelerator_kwargs, check_engine


class Runtime:
    """One process of a run: Accelerate's devices, ranks and collectives, the precision resolved for this device,
    the matmul ceiling cached per device, and what the loop asks of the process (the context it opens around
    forward and backward, reductions). Built once; nothing writes it afterwards."""

    def __init__(self, cfg: DictConfig, run_dir: Path) -> None:
        from accelerate import Accelerator
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our own bar and lines are the console output
        quiet_console()  # third-party INFO lines go to llmexp.log only

        self.started = time.perf_counter()
        self.cfg = cfg
        self.run_dir = run_dir
        use_shared_compile_cache(cfg)  # (run_guarded sets it earlier; this is for callers of train(cfg))
        device_type = "cuda" if torch.cuda.is_available() else "cpu"  # Accelerate's choice (accelerator_kwargs)
        precision = precision_on(cfg.precision.name, device_type)
        if device_type == "cpu":  # bf16 without native support: measured, and emulated where that is faster
            precision = settle_on_cpu(precision)
        self.precision = precision
        """Resolved once, here: the loop, the engines and the DeepSpeed config all take this one."""
        self.world = world_size()
        # DeepSpeed's config fixes the batch plan inside Accelerate (batch_size=auto is refused there).
        deepspeed_plan = make_plan(cfg, self.world) if cfg.deepspeed.stage > 0 else None
        self.accelerator = Accelerator(**accelerator_kwargs(cfg, deepspeed_plan, self.precision.name))
        if cfg.deepspeed.stage > 0:  # before anything reads the process layout (see check_engine)
            check_engine(self.accelerator)
        if self.accelerator.num_processes != self.world:
            raise RuntimeError(f"Accelerate runs {self.accelerator.num_processes} processes, but WORLD_SIZE says "
                               f"{self.world}: start multi-process runs with torchrun or accelerate launch")
        self.device = self.accelerator.device
        if self.device.type == "cuda":
            use_tf32(cfg.precision.tf32)
        self.rank, self.is_main = self.accelerator.process_index, self.accelerator.is_main_process
        self.ceiling_file = Path(cfg.data.cache_dir) / "peak_tflops.json"

    def measure_peak(self) -> tuple[float | None, str | None]:
        """(a matmul ceiling in the training dtype, None), cached per device so later runs start fast; or
        (None, why) when it was measured on shared cores: a guessed ceiling would make every MFU a guess."""
        known = load_ceilings(self.ceiling_file) or {}  # verified: a damaged entry is measured again, with a warning
        if self.ceiling_key() in known:
            return float(known[self.ceiling_key()]), None
        value, kept = self._measure()
        if not kept:  # too low to use or keep: measured again next run
            return None, (f"the matmul ceiling ({value:.3g} TFLOPS) was measured while other processes "
                          "shared the CPU cores, so it is too low and any MFU divided by it too high")
        return value, None

    def remeasure_peak(self) -> float | None:
        """The ceiling measured now, when an MFU came out implausibly high (`monitor.throughput.Mfu`): the cached
        one was probably measured on busy cores (nothing told). A higher one replaces it in the cache; None when
        the cores are shared now too."""
        value, kept = self._measure()
        return value if kept else None

    @property
    def compiles(self) -> bool:
        """train.compile applies: torch.compile traces nothing under emulated bf16's dispatch mode, so it is not
        applied there (the header says so), and no step or eval is then set aside as compile time."""
        return bool(self.cfg.train.compile) and not self.precision.emulate_bf16

    def _ceiling_dtype(self) -> torch.dtype:
        # Emulated bf16 runs its matmuls in fp32: the bf16 ceiling of such a CPU (~0.001 TFLOPS) would measure
        # the path it does not take.
        return (None if self.precision.emulate_bf16 else build.autocast_dtype(self.precision.name)) or torch.float32

    def ceiling_key(self) -> str:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return f"v2|{name}|{self._ceiling_dtype()}|{torch.get_num_threads()}"  # v2: v1's could come from busy cores

    def _measure(self) -> tuple[float, bool]:
        """(the ceiling measured now, whether it was kept): the highest measured on idle cores is the one kept,
        busy cores only ever lower it."""
        value, cores_were_ours = measure_ceiling(self.device, self._ceiling_dtype())
        if cores_were_ours:
            known = load_ceilings(self.ceiling_file) or {}
            known[self.ceiling_key()] = max(value, known.get(self.ceiling_key(), 0.0))
            save_cache(self.ceiling_file, known, "the ceiling is measured again")
        return value, cores_were_ours

    def logger(self, max_steps: int) -> MetricsLogger:
        sinks = make_sinks(self.cfg, self.run_dir) if self.is_main else []
        return MetricsLogger(self.run_dir, max_steps, enabled=self.is_main, sinks=sinks)

    def autocast(self) -> AbstractContextManager[Any]:
        """The compute precision around every forward: the one place that opens it."""
        dtype = build.autocast_dtype(self.precision.name)
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else nullcontext()

    def emulation(self) -> AbstractContextManager[Any]:
        """bf16 emulated on fp32 kernels where this CPU's own bf16 matmuls are slower (`precision.emulate_bf16`),
        around forward *and* backward: the backward's matmuls are bf16 too, and gradient checkpointing recomputes
        the forward inside backward. A no-op elsewhere."""
        return Bf16Emulation() if self.precision.emulate_bf16 else nullcontext()

    @contextmanager
    def compute(self) -> Iterator[None]:
        """`emulation` and `autocast` together, around a forward without a backward (evals, samples)."""
        with self.emulation(), self.autocast():
            yield

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when it is true on any (one tiny all-reduce; free on one process)."""
        return bool(self.reduce(float(flag), "max"))

    def reduce(self, value: float, op: str) -> float:
        """One number reduced over the ranks with `op` (max or min; itself when there is one rank)."""
        if self.world == 1:
            return value
        tensor = torch.tensor(value, device=self.device)
        torch.distributed.all_reduce(tensor, op=getattr(torch.distributed.ReduceOp, op.upper()))
        return tensor.item()

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum") if self.world > 1 else tensor


def use_tf32(on: bool) -> None:
    """TF32 for CUDA's fp32 matmuls and convolutions, or IEEE fp32 (torch's own default). Set on the CUDA backends
    alone: `torch.set_float32_matmul_precision` would reach oneDNN's CPU matmuls too."""
    torch.backends.cuda.matmul.fp32_precision = "tf32" if on else "ieee"
    torch.backends.cudnn.conv.fp32_precision = "tf32" if on else "ieee"
