"""What a run carries from step to step (`LoopState`), and the live objects of a run (`Run`) that
saving, resuming, rolling back, evaluating and finishing all take as one argument."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

    from llmexp.monitor.logger import MetricsLogger
    from llmexp.train.pruning import TrialPruning
    from llmexp.train.runtime import Runtime


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
    model: torch.nn.Module
    optimizer: Any
    log: MetricsLogger
    peak_lr: float
    lr_source: str
    """`config` (the `lr` key) or `auto` (the seed's lr-by-size rule)."""
    state: LoopState = field(default_factory=LoopState)
    train_data: Any = None
    """The train set: a checkpoint asks it for its `position` (a stream's window start)."""
    pruning: TrialPruning | None = None
    """In a search with a pruner: this job's trial, which each eval reports to (`llmexp.train.pruning`)."""
    resumed_from_world_size: int | None = None
    """The number of processes that saved the checkpoint this run resumed from (None: not resumed)."""
    tasks: Any = None
    """The downstream tasks each eval scores (`llmexp.train.tasks.TaskSuite`; empty with eval=loss)."""
    tokenizer: Any = None
