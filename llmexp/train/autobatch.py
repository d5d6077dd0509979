"""`batch_size=auto`: the largest micro-batch that fits in memory, found before the run's model is built: the
estimate's upper bound, then one real step of a throwaway model per candidate, largest first, and the minimum over
ranks (docs/how-to/fsdp-and-deepspeed.md, "Memory").

Accelerate's `find_executable_batch_size` retries the whole training function on OOM: it cannot see a
CPU running out, and a retry would rebuild data and logger too; this probe is one step, then gone.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

from llmexp.config.derived import auto_batch_candidates
from llmexp.errors import UserError
from llmexp.model import build
from llmexp.model.estimate import largest_fitting, memory_budget, meta_facts
from llmexp.model.loss import CausalLMLoss
from llmexp.monitor.throughput import peak_rss_mb, reset_peak_rss, rss_mb
from llmexp.rundir.readers import MiB
from llmexp.train.runtime import Runtime


@dataclass(frozen=True)
class AutoBatch:
    """The choice and how it was made: the `start` record's `batch_size_auto`, kept in checkpoints."""

    chosen: int
    upper_bound: int
    """The largest candidate whose estimate fits `budget_mb`: where the probe started."""
    budget_mb: float
    world_size: int
    probed: list[dict[str, Any]] = field(default_factory=list)
    """One entry per probe step on this rank: micro-batch, fits, measured peak (MiB; CPU: RSS growth)."""
    source: str = "probe"
    """probe, or checkpoint (a resumed run reuses the saved choice and probes nothing)."""
    search_s: float = 0.0
    """Seconds the search took on this rank (the probe steps, their model builds and the estimate)."""
    note: str = ""
    """Why nothing was probed, when that is so."""


def choose_batch_size(cfg: DictConfig, rt: Runtime, vocab_size: int, num_examples: int,
                      saved: dict[str, Any] | None) -> AutoBatch:
    """Settle `batch_size=auto` (the module's docstring) before any engine is built, on every rank (it ends in one
    collective); the batch plan is then `make_plan(cfg, world, micro=choice.chosen)`."""
    if saved and saved.get("world_size") == rt.world and isinstance(saved.get("chosen"), int):
        return AutoBatch(**{**saved, "source": "checkpoint"})
    started = time.perf_counter()
    candidates = auto_batch_candidates(cfg, rt.world, num_examples)
    budget = memory_budget(rt.device.type, rt.world)
    on_cpu = rt.device.type != "cuda"
    upper = largest_fitting(cfg, candidates, budget, on_cpu=on_cpu, **meta_facts(cfg, rt.precision.name, rt.world))
    chosen, probed, note = 0, [], ""
    if cfg.fsdp.name != "none":
        # The probe builds the model unwrapped: under FSDP it would measure unsharded memory and pick far too
        # small. The sharded step lives in the trainer's FSDP engine; until the probe runs through it, the
        # estimate (held to measured FSDP peaks, benchmarks/memory_fsdp.py) decides alone.
        chosen, note = upper, f"fsdp={cfg.fsdp.name}: the estimate alone (the probe step is not sharded)"
    else:
        for micro in candidates[candidates.index(upper):]:
            fits, peak_mb = _probe(cfg, rt, vocab_size, micro, budget)
            probed.append({"micro": micro, "fits": fits, "peak_mb": round(peak_mb, 1)})
            if fits:
                chosen = micro
                break
    chosen = int(rt.reduce(chosen, "min"))  # the largest every rank can run (0: one of them fits none)
    if chosen < 1:
        raise UserError(f"batch_size=auto: not even a micro-batch of 1 fits in memory ({budget / MiB:,.0f} MiB to "
                        f"plan with per process; probed {probed}). Lower data.max_length, set "
                        "model.gradient_checkpointing=true, use peft=lora, or shard the model (deepspeed/fsdp)")
    return AutoBatch(chosen=chosen, upper_bound=upper, budget_mb=round(budget / MiB, 1), world_size=rt.world,
                     probed=probed, search_s=round(time.perf_counter() - started, 2), note=note)


def _probe(cfg: DictConfig, rt: Runtime, vocab_size: int, micro: int, budget: float) -> tuple[bool, float]:
    """(fits, peak MiB) of one training step at `micro`; on CPU the peak is the RSS growth over the step."""
    on_cuda = rt.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(rt.device)
    base_mb = 0.0 if on_cuda else rss_mb()
    reset_peak_rss()
    try:
        _step(cfg, rt, vocab_size, micro)
        fits = True
    except torch.OutOfMemoryError:  # CUDA only; its traceback (and the step's tensors) is gone after this block
        fits = False
    peak_mb = torch.cuda.max_memory_allocated(rt.device) / MiB if on_cuda else peak_rss_mb() - base_mb
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    # CUDA: it ran, so it fits (the OOM is the test); CPU: the measured peak must fit the budget too.
    return fits and (on_cuda or peak_mb * MiB <= budget), peak_mb


def _step(cfg: DictConfig, rt: Runtime, vocab_size: int, micro: int) -> None:
    """One forward + backward + optimizer step on a model and optimizer built as the run builds them; they are
    freed on return. The run's own model is built afterwards (and seeded then): the probe changes nothing."""
    model = CausalLMLoss(build.build_model(cfg, vocab_size, rt.precision.name)).to(rt.device)
    optimizer = build.build_optimizer(cfg, model, 1e-6, rt.device.type)
    ids = torch.randint(0, vocab_size, (micro, cfg.data.max_length), device=rt.device,
                        generator=torch.Generator(rt.device).manual_seed(0))
    with rt.emulation():
        with rt.autocast():
            loss = model(input_ids=ids, labels=ids)
        (loss / ids.numel()).backward()
    optimizer.step()
