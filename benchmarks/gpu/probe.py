"""`python -m llmexp OVERRIDES` in this process, watched (the GPU check's steps 1 and 3):

    python benchmarks/gpu/probe.py OUT.json [--profile-step N] -- OVERRIDES...

- every op that makes the GPU wait for the host, per optimizer step: `torch.cuda.set_sync_debug_mode("warn")`'s
  warnings (scalar reads, nonzero, blocking copies), counted, not printed;
- `torch.cuda.synchronize()` calls and the seconds spent in them, per step (bitsandbytes' 8-bit optimizers call it
  after every parameter: `optim/optimizer.py:335` in 0.50; no public option turns it off);
- with --profile-step N, a torch.profiler trace of step N+1 (N steps done): its CUDA kernels by time, the attention
  ones (flash, memory-efficient, cuDNN or the math path's matmuls and softmax) listed apart.

Steps are told apart by the run's logger (`MetricsLogger.advance`, once an optimizer step); step 1 holds the set-up
and is left out of the medians. On a CPU the CUDA counts are 0 and the trace lists CPU ops: the path, not figures.
Writes OUT.json: {"exit", "steps", "per_step": [...], "median": {...}, "kernels": [...], "attention_kernels": [...]}.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ATTENTION = ("flash", "fmha", "attention", "sdpa", "cudnn_mha", "softmax")
"""Kernel names that belong to attention: flash / memory-efficient / cuDNN kernels, or the math path's softmax."""


def main(argv: list[str]) -> int:
    sep = argv.index("--")
    own, overrides = argv[:sep], argv[sep + 1:]
    out = Path(own[0])
    profile_step = int(own[own.index("--profile-step") + 1]) if "--profile-step" in own else None

    import torch

    from llmexp.monitor.logger import MetricsLogger

    cuda = torch.cuda.is_available()
    now = {"sync_warnings": 0, "synchronize_calls": 0, "synchronize_s": 0.0}
    marks: list[dict[str, float]] = []
    profile: dict[str, Any] = {}
    synchronize = torch.cuda.synchronize

    def counted_synchronize(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        synchronize(*args, **kwargs)
        now["synchronize_calls"] += 1
        now["synchronize_s"] += time.perf_counter() - start

    shown = warnings.showwarning

    def count_warning(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        if "synchronizing CUDA operation" in str(message):
            now["sync_warnings"] += 1
        else:
            shown(message, category, *args, **kwargs)

    advance = MetricsLogger.advance

    def marked(self: MetricsLogger, steps: int = 1) -> None:
        marks.append(dict(now))
        if profile_step is not None and len(marks) == profile_step:
            profile["profiler"] = start_profiler(torch, cuda)
        elif profile_step is not None and len(marks) == profile_step + 1:
            profile.update(stop_profiler(profile.pop("profiler"), cuda))
        advance(self, steps)

    torch.cuda.synchronize = counted_synchronize  # bitsandbytes calls it through the module, at call time
    MetricsLogger.advance = marked  # type: ignore[method-assign]
    warnings.showwarning = count_warning
    warnings.filterwarnings("always", message=".*synchronizing CUDA operation.*")
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    sys.argv = ["llmexp", *overrides]
    code = 0
    try:
        from llmexp.cli.main import cli

        cli()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize = synchronize
        MetricsLogger.advance = advance  # type: ignore[method-assign]
    per_step = [{k: after[k] - before[k] for k in after} for before, after in itertools.pairwise(marks)]
    median = {k: statistics.median(s[k] for s in per_step) for k in now} if per_step else {}
    facts = {"exit": code, "cuda": cuda, "steps": len(marks), "per_step": per_step, "median": median,
             **{k: v for k, v in profile.items() if k != "profiler"}}
    out.write_text(json.dumps(facts, indent=1))
    return code


def start_profiler(torch: Any, cuda: bool) -> Any:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    prof = profile(activities=activities)
    prof.__enter__()
    return prof


def stop_profiler(prof: Any, cuda: bool) -> dict[str, Any]:
    """The profiled step's kernels (CUDA) or ops (CPU), by total time, the attention ones apart."""
    prof.__exit__(None, None, None)
    rows = []
    for e in prof.key_averages():
        us = e.device_time_total if cuda else e.self_cpu_time_total
        if us > 0 and (not cuda or e.device_type.name == "CUDA"):
            rows.append({"name": e.key[:120], "calls": e.count, "ms": round(us / 1000, 3)})
    rows.sort(key=lambda r: -r["ms"])
    attention = [r for r in rows if any(a in r["name"].lower() for a in ATTENTION)]
    return {"kernels": rows[:25], "attention_kernels": attention[:15]}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
