"""What set-up resolved once (`RunDescription`, frozen), what a run carries from step to step (`LoopState`, the
only thing the loop writes), and the live objects of a run (`Run`) that saving, resuming, rolling back,
evaluating and finishing all take as one argument."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmexp.monitor.detectors import CPU_MFU_PLAUSIBLE
from llmexp.monitor.throughput import Mfu, ThroughputWindow

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

    from llmexp.config.derived import BatchPlan
    from llmexp.machine.precision import Precision
    from llmexp.monitor.detectors import MonitorSettings
    from llmexp.monitor.logger import MetricsLogger
    from llmexp.train.autobatch import AutoBatch
    from llmexp.train.engines.base import Engine
    from llmexp.train.pruning import TrialPruning
    from llmexp.train.runtime import Runtime


@dataclass(frozen=True)
class RunDescription:
    """What set-up resolved for this run, once, before the first step (`setup.describe`): the loop, the
    checkpoints and the summary read it, nothing writes it."""

    precision: Precision
    """What the run computes in, and whether that bf16 is emulated here."""
    plan: BatchPlan
    """Micro-batch x accumulation x processes (batch_size=auto settled before any engine was built)."""
    auto_batch: AutoBatch | None
    lr: float
    """The peak learning rate."""
    lr_source: str
    """Where `lr` came from: one of `schedule.resolve_lr`'s sources, or `find` (lr=find's range test)."""
    monitor: MonitorSettings
    max_steps: int
    warmup_steps: int
    num_params: int
    """Trainable parameters (the adapters' only under peft)."""
    total_params: int
    flops_per_token: float
    peak_tflops: float | None
    """The matmul ceiling MFU divides by; None when it cannot be trusted (`mfu_note` says why)."""
    mfu_note: str | None
    data_fingerprint: str
    """The token cache key; each checkpoint keeps it, so a resume on other data is caught."""
    data_seed: int
    started: float
    """`time.perf_counter()` when set-up began."""
    model_facts: dict[str, Any] = field(default_factory=dict)
    """What the model is (`llmexp.model.facts.model_facts`), and `cpu_matmul`: where its fp32 CPU matmuls go."""

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


@dataclass
class LoopState:
    """Everything besides weights, optimizer and RNG that the next step depends on."""

    step: int = 0
    data_offset: int = 0
    lr_scale: float = 1.0
    rollbacks: int = 0
    skipped_steps: int = 0
    consecutive_anomalies: int = 0
    recent_losses: list[float] = field(default_factory=list)
    best_eval_loss: float = math.inf
    best_eval_step: int = -1
    evals_since_best: int = 0
    last_eval_step: int = -1
    num_examples: int = 0
    seen_findings: list[str] = field(default_factory=list)
    data_state: dict[str, Any] = field(default_factory=dict)
    """Where a stateful train set stands (data.streaming: its window start); empty for the cached data."""
    batch_size_auto: dict[str, Any] = field(default_factory=dict)
    """batch_size=auto: the choice (`train.autobatch.AutoBatch`), reused on resume instead of probing again."""


@dataclass
class Run:
    """One run's live objects, built once by the loop."""

    cfg: DictConfig
    rt: Runtime
    desc: RunDescription
    engine: Engine
    model: torch.nn.Module
    optimizer: Any
    log: MetricsLogger
    state: LoopState = field(default_factory=LoopState)
    train_data: Any = None
    """The train set: a checkpoint asks it for its `position` (a stream's window start)."""
    pruning: TrialPruning | None = None
    """In a search with a pruner: this job's trial, which each eval reports to (`llmexp.train.pruning`)."""
    resumed_from_world_size: int | None = None
    """The number of processes that saved the checkpoint this run resumed from (None: not resumed)."""
    tokenizer: Any = None
    """The run's tokenizer: the tasks and the samples encode with it, and `model/` saves it."""
    window: ThroughputWindow = field(default_factory=ThroughputWindow)
    """Tokens and seconds of the training steps (the loop's)."""
    mfu: Mfu = field(init=False)
    """MFU of each train record and of the summary, with its switch-off (`monitor.throughput.Mfu`)."""

    def __post_init__(self) -> None:
        # On a CPU an MFU above CPU_MFU_PLAUSIBLE means a ceiling measured on busy cores: measured again, once.
        self.mfu = Mfu(self.desc.flops_per_token, self.desc.peak_tflops, self.desc.plan.world,
                       plausible=CPU_MFU_PLAUSIBLE if self.rt.device.type == "cpu" else 1.0,
                       remeasure=None if self.cfg.train.peak_tflops else self.rt.remeasure_peak)
