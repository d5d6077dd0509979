"""`lr=find`: an lr range test in the run's own process, then training at its pick from a fresh start.

The test, its three rules (`suggest`), why the defaults (200 steps, `steep`) are the measured best, and how it
leaves no trace in the run (the training after it is bitwise that of a plain run at the pick, tests/test_lr_find.py):
docs/how-to/schedules.md. A rerun in the same directory reads `lr_find.json`.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from llmexp.config.validation import is_lr_find
from llmexp.errors import UserError
from llmexp.model.rng import rng_untouched
from llmexp.monitor.logger import MetricsLogger
from llmexp.report.plots import plot_lr_find
from llmexp.rundir.files import write_json_atomic
from llmexp.rundir.readers import Damaged, load_json, reader
from llmexp.train.runtime import Runtime
from llmexp.train.schedule import set_lr
from llmexp.train.setup import describe
from llmexp.train.state import Run

SMOOTHING = 0.98
DIVERGED_FACTOR = 4.0


def smooth(losses: list[float]) -> list[float]:
    """fastai's bias-corrected exponential moving average."""
    avg, out = 0.0, []
    for i, loss in enumerate(losses, start=1):
        avg = SMOOTHING * avg + (1 - SMOOTHING) * loss
        out.append(avg / (1 - SMOOTHING ** i))
    return out


def _valley(lrs: list[float], smoothed: list[float], finite: list[int]) -> float:
    """The longest falling run (a longest strictly decreasing subsequence of the smoothed loss, so that noise does
    not cut it short), and the lr half-way between its first and its last point."""
    length = {i: 1 for i in finite}
    first = {i: i for i in finite}
    for n, i in enumerate(finite):
        for j in finite[:n]:
            if smoothed[i] < smoothed[j] and length[j] + 1 > length[i]:
                length[i], first[i] = length[j] + 1, first[j]
    end = max(finite, key=lambda i: (length[i], -i))  # the earliest of the longest
    return lrs[(first[end] + end) // 2]


def suggest(lrs: list[float], smoothed: list[float], rule: str) -> dict[str, Any]:
    """Every rule's pick (`train.lr_find_rule`'s options) over the finite part of the curve, `rule`'s as the
    suggestion; and the minimum."""
    finite = [i for i, v in enumerate(smoothed) if math.isfinite(v)]
    best = min(finite, key=smoothed.__getitem__)
    # steep: the most negative slope of the smoothed loss against log lr, before its minimum (past it the loss rises)
    slopes = {i: (smoothed[i + 1] - smoothed[i]) / math.log(lrs[i + 1] / lrs[i]) for i in finite if i < best}
    picks = {"minimum": lrs[best] / 10, "steep": lrs[min(slopes, key=slopes.__getitem__)] if slopes else lrs[best],
             "valley": _valley(lrs, smoothed, finite)}
    return {"rule": rule, "suggestion": picks[rule], "picks": picks, "lr_min_loss": lrs[best],
            "min_smoothed_loss": smoothed[best]}


ForwardBackward = Callable[[Run, Any], tuple[torch.Tensor, int, int]]
"""The loop's `train.forward_backward(run, train_ds)`: (loss sum on this rank, target tokens, tokens)."""


def range_test(cfg: DictConfig, rt: Runtime, vocab_size: int, train_ds: Any, data_fingerprint: str,
               forward_backward: ForwardBackward) -> dict[str, Any]:
    """Run the test on a throwaway run, its engine, model and optimizer set up as the run's own (`setup.describe`)
    and logging nothing; the curve and the pick (every rank gets the same)."""
    t, start_s = cfg.train, time.perf_counter()
    steps, first, last = int(t.lr_find_steps), float(t.lr_find_start), float(t.lr_find_end)
    with rng_untouched(rt.device):
        cfg = with_lr(cfg, first)
        run = Run(cfg, rt, *describe(cfg, rt, vocab_size, train_ds, data_fingerprint),
                  MetricsLogger(rt.run_dir, steps, enabled=False))
        curve, stopped = _rising_lr(run, train_ds, forward_backward, steps, first, last)
        del run
        rt.accelerator.free_memory()  # Accelerate's references to the throwaway model and optimizer
    if len(curve) < 3:
        raise UserError(f"lr=find: the loss diverged within {len(curve)} steps of train.lr_find_start="
                        f"{first:g}; lower train.lr_find_start (e.g. 1e-8) or check the data")
    picked = suggest([c["lr"] for c in curve], [c["smoothed"] for c in curve], t.lr_find_rule)
    return {**picked, "stopped": stopped, "steps_run": len(curve), "lr_find_steps": steps,
            "lr_find_start": first, "lr_find_end": last, "seconds": round(time.perf_counter() - start_s, 2),
            "curve": curve}


def _rising_lr(run: Run, train_ds: Any, forward_backward: ForwardBackward, steps: int, first: float,
               last: float) -> tuple[list[dict[str, Any]], str]:
    """The steps of the test, through the loop's own `forward_backward` and `Engine` calls, until the smoothed
    loss diverges or the lr reaches `last`: (the curve, why it stopped)."""
    rt, engine, optimizer = run.rt, run.engine, run.optimizer
    curve: list[dict[str, Any]] = []
    for step in range(steps):
        lr = first * (last / first) ** (step / max(1, steps - 1))  # rising exponentially
        set_lr(optimizer, lr)  # muP's per-part factors too: the curve is over the base lr, as a run sets it
        loss_sum, n_targets, _ = forward_backward(run, train_ds)
        engine.clip(run.model, optimizer, run.cfg.train.max_grad_norm, loss_sum.device)  # fp16: unscaled first
        loss = float(rt.reduce_sum(loss_sum) / n_targets)
        smoothed = smooth([*(c["loss"] for c in curve), loss])[-1]
        curve.append({"step": step, "lr": lr, "loss": loss, "smoothed": smoothed})
        _say(rt, f"lr_find {step:>4} | lr {lr:.3e} | loss {loss:.4f} | smoothed {smoothed:.4f}")
        if not math.isfinite(smoothed) or smoothed > DIVERGED_FACTOR * min(c["smoothed"] for c in curve):
            return curve, f"diverged at step {step} (smoothed loss above {DIVERGED_FACTOR:g}x its minimum)"
        engine.step(optimizer)  # fp16: through the throwaway engine's own scaler
        optimizer.zero_grad(set_to_none=True)
        run.state.step += 1
    return curve, "reached train.lr_find_end"


def _say(rt: Runtime, line: str) -> None:
    if rt.is_main:
        print(line, file=sys.stderr, flush=True)


@reader
def read_lr_find(path: Path) -> dict[str, Any]:
    """lr_find.json of an earlier launch in this run directory. A cache: a pick no range test could have made (not
    a number between the test's first lr over 10 and its last lr) is a miss, and the test runs again."""
    saved = load_json(path, read_lr_find)
    lr, first, last = saved["suggestion"], saved["lr_find_start"], saved["lr_find_end"]
    if not (0 < first < last < math.inf and first / 10 * (1 - 1e-9) <= lr <= last * (1 + 1e-9)):
        raise Damaged(path, f"its suggestion {lr!r} is not an lr a test from {first!r} to {last!r} could pick")
    return saved


def settle_lr(cfg: DictConfig, rt: Runtime, vocab_size: int, train_ds: Any, data_fingerprint: str,
              forward_backward: ForwardBackward) -> tuple[DictConfig, dict[str, Any] | None]:
    """lr=find: (the config to train with, its `lr` the test's pick; the test's result); any other lr: (cfg,
    None). Before the run's own set-up, which then starts afresh."""
    if not is_lr_find(cfg.lr):
        return cfg, None
    path, t = rt.run_dir / "lr_find.json", cfg.train
    saved = read_lr_find(path)  # an earlier launch's result in this directory, reused for the same test
    test = {"lr_find_steps": t.lr_find_steps, "lr_find_start": t.lr_find_start, "lr_find_end": t.lr_find_end,
            "rule": t.lr_find_rule}
    if saved and all(saved.get(k) == v for k, v in test.items()):
        _say(rt, f"lr_find: reusing {path}: lr {saved['suggestion']:.4g}")  # type: ignore[index]
        return with_lr(cfg, saved["suggestion"]), saved  # type: ignore[index]
    result = range_test(cfg, rt, vocab_size, train_ds, data_fingerprint, forward_backward)
    if rt.is_main:
        write_json_atomic(path, result)
        try:
            plot_lr_find(result, rt.run_dir / "lr_find.png")
        except Exception as err:  # a plotting problem must not lose the result
            _say(rt, f"warning: could not plot lr_find.png: {err!r}")
    others = ", ".join(f"{name} {lr:.3g}" for name, lr in result["picks"].items() if name != result["rule"])
    _say(rt, f"lr_find: suggested lr {result['suggestion']:.4g} (rule {result['rule']}; {others}; "
             f"{result['stopped']}); {path}")
    return with_lr(cfg, result["suggestion"]), result


def with_lr(cfg: DictConfig, lr: float) -> DictConfig:
    """A copy of the config with `lr` set (the pick: what a plain run at that lr has)."""
    out = OmegaConf.create({**OmegaConf.to_container(cfg, resolve=False), "lr": float(lr)})  # type: ignore[dict-item]
    OmegaConf.set_struct(out, True)
    return out
