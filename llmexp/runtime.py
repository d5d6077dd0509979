"""The engine room of a run: devices and processes (Accelerate), precision, the batch plan,
and the per-step mechanics the loop calls (backward, unscale + clip, the optimizer step with
its anomaly policy, metric records).
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from llmexp import build
from llmexp.errors import UserError
from llmexp.metrics import (
    MetricsLogger,
    flops_per_token,
    make_sinks,
    measure_ceiling,
    peak_memory_mb,
    quiet_console,
    safe_exp,
)
from llmexp.monitor import MonitorSettings

if TYPE_CHECKING:
    from llmexp.state import LoopState


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch splits into micro-batches and processes."""

    micro: int
    accum: int
    world: int
    fixed_steps: int
    epochs: float

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.world

    def max_steps(self, num_examples: int) -> int:
        if self.fixed_steps > 0:
            return self.fixed_steps
        return max(1, math.ceil(self.epochs * num_examples / self.global_batch))


def make_plan(cfg: DictConfig, world: int) -> BatchPlan:
    """Derive accumulation from `train.global_batch_size` when it is set."""
    t, micro = cfg.train, cfg.batch_size
    accum = t.gradient_accumulation_steps
    if t.global_batch_size is not None:
        per_step = micro * world
        if t.global_batch_size % per_step:
            raise UserError(f"train.global_batch_size={t.global_batch_size} is not a multiple of batch_size x "
                            f"processes = {micro} x {world} = {per_step}; pick a multiple of {per_step}")
        accum = t.global_batch_size // per_step
    return BatchPlan(micro=micro, accum=accum, world=world, fixed_steps=t.max_steps, epochs=t.num_train_epochs)


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

        from llmexp.distributed import accelerator_kwargs

        hf_logging.disable_progress_bar()  # our own bar and lines are the console output
        quiet_console()  # third-party INFO lines go to llmexp.log only

        self.cfg = cfg
        self.run_dir = run_dir
        # One compile cache for every run and sweep job: torch.compile pays for itself after ~40 steps, not ~400.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cfg.data.cache_dir) / "torchinductor"))
        self.accelerator = Accelerator(**accelerator_kwargs(cfg))
        if cfg.deepspeed.stage > 0:  # before anything reads the process layout (see check_engine)
            from llmexp.distributed import check_engine

            check_engine(self.accelerator)
        self.device = self.accelerator.device
        self.rank, self.is_main = self.accelerator.process_index, self.accelerator.is_main_process
        self.precision = build.resolve_precision(cfg.precision.name, self.device.type)
        self.bf16_warning = build.bf16_emulation_warning(self.precision, self.device.type)
        self.plan = make_plan(cfg, self.accelerator.num_processes)
        self.data_seed = cfg.train.seed_data if cfg.train.seed_data is not None else cfg.seed
        self.deepspeed = cfg.deepspeed.stage > 0  # the engine owns accumulation, clipping, fp16 scaling, the step
        self.micro_steps_done = 0  # DeepSpeed: backward calls since the last step (the boundary is the last)
        self.scaler = (torch.amp.GradScaler(self.device.type, init_scale=cfg.precision.init_scale,
                                            growth_interval=cfg.precision.growth_interval)
                       if self.precision == "fp16" and not self.deepspeed else None)
        self.num_params = 0
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

    # ------------------------------------------------------------------ building
    def build(self, cfg: DictConfig, vocab_size: int) -> tuple[torch.nn.Module, Any, float, str]:
        """Model (wrapped with its loss), optimizer and peak lr, prepared for this device."""
        from llmexp.guard import monitor_settings
        from llmexp.loss import CausalLMLoss
        from llmexp.train import resolve_lr

        torch.manual_seed(cfg.seed)  # same init on every rank
        lm = build.build_model(cfg, vocab_size)
        self.num_params = build.count_params(lm)
        c = lm.config
        self.flops_per_token = flops_per_token(self.num_params, c.num_hidden_layers, c.hidden_size,
                                               cfg.data.max_length)
        if cfg.train.peak_tflops:
            self.peak_tflops = cfg.train.peak_tflops
        else:
            self.peak_tflops, self.mfu_note = self._measure_peak()
        peak_lr, source = resolve_lr(cfg, self.num_params)
        self.monitor_settings = monitor_settings(cfg, self.precision, peak_lr)
        model = CausalLMLoss(lm)
        optimizer = build.build_optimizer(cfg, model, peak_lr, self.device.type)
        model, optimizer = self.accelerator.prepare(model, optimizer)
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
        try:
            known = json.loads(cache.read_text())
        except (OSError, ValueError):
            known = {}
        if key not in known:
            value, cores_were_ours = measure_ceiling(self.device, dtype)
            if not cores_were_ours:  # too low to use or keep: measured again next run
                return None, (f"the matmul ceiling ({value:.3g} TFLOPS) was measured while other processes "
                              "shared the CPU cores, so it is too low and any MFU divided by it too high")
            known[key] = value
            from llmexp.paths import write_json_atomic

            write_json_atomic(cache, known)
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
            "batch_size": self.plan.micro, "world_size": self.plan.world, "optimizer": c.optimizer.name,
            "scheduler": c.scheduler.name, "precision_requested": c.precision.name, "device": self.device.type,
            "peak_tflops": self.peak_tflops}
        if self.bf16_warning:
            facts.update(bf16_emulated=self.bf16_warning, bf16_advice=build.BF16_EMULATION_ADVICE)
        if self.mfu_note:
            facts["mfu_note"] = self.mfu_note
        return facts

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    # ------------------------------------------------------------------ per-step mechanics
    def autocast(self) -> AbstractContextManager[Any]:
        dtype = build.autocast_dtype(self.precision)
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        if self.deepspeed:
            from llmexp.distributed import engine_backward

            return engine_backward(self, loss)
        self.accelerator.backward(self.scaler.scale(loss) if self.scaler is not None else loss)

    def unscale_and_clip(self, model: torch.nn.Module, optimizer: Any, max_norm: float) -> torch.Tensor:
        """Unscale fp16 grads, then clip; returns the pre-clip global norm (inf/nan if non-finite)."""
        if self.deepspeed:  # the engine clips to train.max_grad_norm and steps here (see llmexp.distributed)
            from llmexp.distributed import engine_step

            return engine_step(self)
        if self.scaler is not None:
            self.scaler.unscale_(_inner(optimizer))
        limit = max_norm if max_norm > 0 else math.inf
        norm = self.accelerator.clip_grad_norm_(model.parameters(), limit)
        return norm if isinstance(norm, torch.Tensor) else torch.tensor(float(norm or 0.0))

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when it is true on any (one tiny all-reduce; free on one process)."""
        if self.plan.world == 1:
            return flag
        return bool(self.reduce_sum(torch.tensor([float(flag)], device=self.device)).item() > 0)

    def reduce_max(self, value: float) -> float:
        if self.plan.world == 1:
            return value
        tensor = torch.tensor(value, device=self.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return float(tensor.item())

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum") if self.plan.world > 1 else tensor

    def preemption(self) -> AbstractContextManager[Any]:
        from llmexp.checkpoint import PreemptionSignal

        return PreemptionSignal()

    def check_step(self, state: LoopState, optimizer: Any, loss: float, grad_norm: float,
                   log: MetricsLogger) -> str:
        """Step the optimizer, or apply the anomaly policy: returns ok, skipped, rollback or diverged."""
        from llmexp.guard import judge_step

        if self.deepspeed:  # the engine has already stepped (or skipped a non-finite step)
            from llmexp.distributed import judge_engine_step

            return judge_engine_step(self, state, loss, grad_norm, log)
        verdict = judge_step(self.cfg, state, loss, grad_norm, fp16=self.scaler is not None,
                             settings=self.monitor_settings, log=log)
        if verdict == "ok":
            self._optimizer_step(state, optimizer)
        optimizer.zero_grad(set_to_none=True)
        return verdict

    def _optimizer_step(self, state: LoopState, optimizer: Any) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        scale = self.scaler.get_scale()
        self.scaler.step(_inner(optimizer))  # skips the step when grads overflowed
        self.scaler.update()
        if self.scaler.get_scale() < scale:
            state.skipped_steps += 1

    def train_record(self, state: LoopState, loss: float, grad_norm: float, optimizer: Any,
                     window: ThroughputWindow) -> dict[str, Any]:
        tokens_per_sec = window.take()
        record = {"event": "train", "step": state.step, "loss": loss, "ppl": safe_exp(loss),
                  "lr": optimizer.param_groups[0]["lr"], "grad_norm": grad_norm, "tokens_per_sec": tokens_per_sec,
                  "mfu": self.mfu(tokens_per_sec), "mem_mb": peak_memory_mb(self.device),
                  "epoch": state.step * self.plan.global_batch / max(1, state.num_examples),
                  "time_s": time.perf_counter() - self.started, "skipped_steps": state.skipped_steps}
        if self._mfu_note_pending:  # said once, on the record where MFU stopped being reported
            record["mfu_note"], self._mfu_note_pending = self.mfu_note, False
        if self.scaler is not None:
            record["loss_scale"] = self.scaler.get_scale()
        if self.deepspeed and self.precision == "fp16":
            from llmexp.distributed import loss_scale

            record["loss_scale"] = loss_scale(self)
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


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's wrapper (GradScaler needs the real one)."""
    return getattr(optimizer, "optimizer", optimizer)


def setup_runtime(cfg: DictConfig) -> Runtime:
    """The runtime of this Hydra job; its output directory (the same on every rank) is the run directory."""
    from hydra.core.hydra_config import HydraConfig

    return Runtime(cfg, Path(HydraConfig.get().runtime.output_dir))
