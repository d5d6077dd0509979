"""One process's set-up for a run: devices and processes (Accelerate), the resolved precision, the
batch plan, the step engine (plain, DeepSpeed or FSDP: `llmexp.train.engines`), the
model and optimizer, and the facts and metric records that describe them (parameters, MFU, throughput).
"""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from llmexp.config.derived import (
    BF16_EMULATION_ADVICE,
    bf16_emulation_warning,
    make_plan,
    resolve_precision,
    world_size_from_env,
)
from llmexp.model import build
from llmexp.monitor.console import quiet_console
from llmexp.monitor.detectors import MonitorSettings, settings_from_config
from llmexp.monitor.logger import MetricsLogger, safe_exp
from llmexp.monitor.sinks import make_sinks
from llmexp.monitor.throughput import flops_per_token, load_ceilings, measure_ceiling, peak_memory_mb, save_ceilings
from llmexp.train.engines.deepspeed import DeepSpeedEngine
from llmexp.train.engines.plain import PlainEngine

if TYPE_CHECKING:
    from llmexp.train.state import LoopState


@dataclass
class ThroughputWindow:
    """Tokens and busy seconds since the last log (eval and checkpoint time excluded)."""

    tokens: int = 0
    seconds: float = 0.0
    total_tokens: int = 0
    total_seconds: float = 0.0
    _start: float = field(default_factory=time.perf_counter)

    def begin(self) -> None:
        self._start = time.perf_counter()

    def add(self, tokens: int) -> None:
        elapsed = time.perf_counter() - self._start
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + elapsed
        self.total_tokens, self.total_seconds = self.total_tokens + tokens, self.total_seconds + elapsed

    def discard(self) -> float:
        """Drop the step just timed from the throughput (a compile step); return its seconds."""
        return time.perf_counter() - self._start

    def take(self) -> float:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        self.tokens, self.seconds = 0, 0.0
        return rate


class Runtime:
    """One process's view of the run: accelerator, device, precision and the batch plan."""

    def __init__(self, cfg: DictConfig, run_dir: Path) -> None:
        from accelerate import Accelerator
        from transformers.utils import logging as hf_logging

        from llmexp.train.distributed import accelerator_kwargs

        hf_logging.disable_progress_bar()  # our own bar and lines are the console output
        quiet_console()  # third-party INFO lines go to llmexp.log only

        self.cfg = cfg
        self.run_dir = run_dir
        # One compile cache for every run and sweep job: torch.compile pays for itself after ~40 steps, not ~400.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cfg.data.cache_dir) / "torchinductor"))
        # Resolved once, here, and handed on (the DeepSpeed config is derived from the same two).
        device_type = "cuda" if torch.cuda.is_available() else "cpu"  # Accelerate's choice (accelerator_kwargs)
        self.precision = resolve_precision(cfg.precision.name, device_type)
        self.bf16_warning = bf16_emulation_warning(self.precision, device_type)
        self.plan = make_plan(cfg, world_size_from_env())  # batch_size=auto: micro 1 until `autobatch` settles it
        self.auto_batch: dict[str, Any] | None = None
        """batch_size=auto: how the micro-batch was chosen (`autobatch.AutoBatch.record`); None otherwise."""
        self.accelerator = Accelerator(**accelerator_kwargs(cfg, self.plan, self.precision))
        if cfg.deepspeed.stage > 0:  # before anything reads the process layout (see check_engine)
            from llmexp.train.distributed import check_engine

            check_engine(self.accelerator)
        if self.accelerator.num_processes != self.plan.world:
            raise RuntimeError(f"Accelerate runs {self.accelerator.num_processes} processes, but WORLD_SIZE says "
                               f"{self.plan.world}: start multi-process runs with torchrun or accelerate launch")
        self.device = self.accelerator.device
        self.rank, self.is_main = self.accelerator.process_index, self.accelerator.is_main_process
        self.data_seed = cfg.train.seed_data if cfg.train.seed_data is not None else cfg.seed
        self.engine = self._engine(cfg)
        self.num_params = 0
        """Trainable parameters (the adapters' only under peft)."""
        self.total_params = 0
        self.flops_per_token = 0.0
        self.peak_tflops: float | None = None
        """The matmul ceiling MFU divides by; None when it cannot be trusted (`mfu_note` says why)."""
        self.mfu_note: str | None = None
        self._mfu_note_pending = False
        self.compile_time_s = 0.0
        self.data_fingerprint = ""  # the token cache key, set once the data is built (checkpoints keep it)
        self.started = time.perf_counter()
        self.window = ThroughputWindow()
        self.monitor_settings = MonitorSettings()

    def _engine(self, cfg: DictConfig) -> PlainEngine:
        if cfg.deepspeed.stage > 0:
            return DeepSpeedEngine(self.accelerator, self.precision, self.plan, cfg.deepspeed.stage)
        if cfg.fsdp.name != "none":
            from llmexp.train.engines.fsdp import FsdpEngine

            return FsdpEngine(self.accelerator, self.precision, self.plan, cfg.fsdp.name, cfg.fsdp.cpu_offload)
        return PlainEngine(self.accelerator, self.precision, cfg.precision.init_scale, cfg.precision.growth_interval)

    # ------------------------------------------------------------------ building
    def build(self, cfg: DictConfig, vocab_size: int) -> tuple[torch.nn.Module, Any, float, str]:
        """Model (wrapped with its loss), optimizer and peak lr, prepared for this device."""
        from llmexp.model.loss import CausalLMLoss
        from llmexp.train.schedule import resolve_lr

        torch.manual_seed(cfg.seed)  # same init on every rank
        lm = build.build_model(cfg, vocab_size, self.precision)
        self.num_params = build.count_params(lm)
        self.total_params = build.count_params(lm, trainable_only=False)
        self.engine.trainable_only = cfg.peft.name != "none"  # checkpoints: the adapters, not the frozen base
        c = lm.config
        # Every weight takes part in forward and backward (6N); with adapters the frozen weights need no
        # weight gradient (4N), which this count leaves in: MFU is then a slight overestimate.
        self.flops_per_token = flops_per_token(self.total_params, c.num_hidden_layers, c.hidden_size,
                                               cfg.data.max_length)
        if cfg.train.peak_tflops:
            self.peak_tflops = cfg.train.peak_tflops
        else:
            self.peak_tflops, self.mfu_note = self._measure_peak()
        peak_lr, source = resolve_lr(cfg, self.total_params)
        facts = {"model": {"name_or_path": cfg.model.name_or_path}, "train": {"max_grad_norm": cfg.train.max_grad_norm}}
        self.monitor_settings = settings_from_config(facts, lr=peak_lr, precision=self.precision)
        model = self.engine.shard(CausalLMLoss(lm))  # FSDP: before the optimizer sees the parameters
        optimizer = build.build_optimizer(cfg, model, peak_lr, self.device.type)
        model, optimizer = self.engine.prepare(model, optimizer)
        if cfg.train.compile:
            model = torch.compile(model)
        return model, optimizer, peak_lr, source

    def _measure_peak(self) -> tuple[float | None, str | None]:
        """(a matmul ceiling in the training dtype, None) cached per device so later runs start fast; or
        (None, why) when it was measured on shared cores: a guessed ceiling would make every MFU a guess."""
        dtype = build.autocast_dtype(self.precision) or torch.float32
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        key = f"v2|{name}|{dtype}|{torch.get_num_threads()}"  # v2: v1 entries could come from a busy machine
        cache = Path(self.cfg.data.cache_dir) / "peak_tflops.json"
        known = load_ceilings(cache)  # verified on read: a damaged entry is measured again, with a warning
        if key not in known:
            value, cores_were_ours = measure_ceiling(self.device, dtype)
            if not cores_were_ours:  # too low to use or keep: measured again next run
                return None, (f"the matmul ceiling ({value:.3g} TFLOPS) was measured while other processes "
                              "shared the CPU cores, so it is too low and any MFU divided by it too high")
            known[key] = value
            save_ceilings(cache, known)
        return float(known[key]), None

    def logger(self, max_steps: int) -> MetricsLogger:
        sinks = make_sinks(self.cfg, self.run_dir) if self.is_main else []
        return MetricsLogger(self.run_dir, max_steps, enabled=self.is_main, sinks=sinks)

    def start_facts(self, max_steps: int) -> dict[str, Any]:
        """What the `start` record adds about the setup: the console header prints it, and the detectors
        turn `bf16_emulated` and `mfu_note` into findings."""
        c = self.cfg
        facts: dict[str, Any] = {
            "run_dir": str(self.run_dir), "model": c.model.name, "model_path": c.model.name_or_path,
            "data": c.data.name, "max_length": c.data.max_length, "max_steps": max_steps,
            "batch_size": self.plan.micro, "world_size": self.plan.world, "fsdp": c.fsdp.name,
            "optimizer": c.optimizer.name,
            "scheduler": c.scheduler.name, "precision_requested": c.precision.name, "device": self.device.type,
            "peak_tflops": self.peak_tflops}
        if self.auto_batch:
            facts["batch_size_auto"] = self.auto_batch
        if self.bf16_warning:
            facts.update(bf16_emulated=self.bf16_warning, bf16_advice=BF16_EMULATION_ADVICE)
        if self.mfu_note:
            facts["mfu_note"] = self.mfu_note
        return facts

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    # ------------------------------------------------------------------ what the loop asks of the process
    def autocast(self) -> AbstractContextManager[Any]:
        dtype = build.autocast_dtype(self.precision)
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else nullcontext()

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when it is true on any (one tiny all-reduce; free on one process)."""
        if self.plan.world == 1:
            return flag
        return bool(self.reduce_sum(torch.tensor([float(flag)], device=self.device)).item() > 0)

    def reduce_max(self, value: float) -> float:
        return float(self._all_reduce(value, torch.distributed.ReduceOp.MAX))

    def reduce_min(self, value: int) -> int:
        return int(self._all_reduce(value, torch.distributed.ReduceOp.MIN))

    def _all_reduce(self, value: float, op: Any) -> float:
        """One number reduced over the ranks with `op` (itself when there is one rank)."""
        if self.plan.world == 1:
            return value
        tensor = torch.tensor(value, device=self.device)
        torch.distributed.all_reduce(tensor, op=op)
        return tensor.item()

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum") if self.plan.world > 1 else tensor

    def preemption(self) -> AbstractContextManager[Any]:
        from llmexp.train.preemption import PreemptionSignal

        return PreemptionSignal()

    def train_record(self, state: LoopState, loss: float, grad_norm: float, optimizer: Any,
                     window: ThroughputWindow) -> dict[str, Any]:
        tokens_per_sec = window.take()
        record = {"event": "train", "step": state.step, "loss": loss, "ppl": safe_exp(loss),
                  "lr": optimizer.param_groups[0]["lr"], "grad_norm": grad_norm, "tokens_per_sec": tokens_per_sec,
                  "mfu": self.mfu(tokens_per_sec), "mem_mb": peak_memory_mb(self.device),
                  "epoch": state.step * self.plan.global_batch / state.num_examples if state.num_examples else None,
                  "time_s": time.perf_counter() - self.started, "skipped_steps": state.skipped_steps}
        if self._mfu_note_pending:  # said once, on the record where MFU stopped being reported
            record["mfu_note"], self._mfu_note_pending = self.mfu_note, False
        if (scale := self.engine.loss_scale()) is not None:
            record["loss_scale"] = scale
        return record

    def mfu(self, tokens_per_sec: float) -> float | None:
        """Model FLOPs utilisation in [0, 1], or None when the ceiling is not trusted.

        A value above 1 proves the ceiling was measured too low: from then on MFU is None, and the
        next train record carries the reason (`mfu_note`)."""
        if self.peak_tflops is None or self.peak_tflops <= 0:
            return None
        value = self.flops_per_token * tokens_per_sec / (self.peak_tflops * 1e12 * self.plan.world)
        if value > 1.0:
            self.mfu_note = (f"MFU came out at {value:.0%}, above 100%: the matmul ceiling ({self.peak_tflops:.3g} "
                             "TFLOPS) is too low (train.peak_tflops, or peak_tflops.json in data.cache_dir, which "
                             "you may delete to measure it again)")
            self.peak_tflops, self._mfu_note_pending = None, True
            return None
        return value


def setup_runtime(cfg: DictConfig) -> Runtime:
    """The runtime of this Hydra job; its output directory (the same on every rank) is the run directory."""
    from hydra.core.hydra_config import HydraConfig

    return Runtime(cfg, Path(HydraConfig.get().runtime.output_dir))
