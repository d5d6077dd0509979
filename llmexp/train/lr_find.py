"""`lr=find`: an lr range test in the run's own process, then training at its pick from a fresh start.

The test (Smith 2015, "Cyclical Learning Rates for Training Neural Networks", section 3.3; fastai's `lr_find`):
a throwaway copy of the run's model, built as the run builds it, trains on the run's first batches while the lr
rises exponentially from `train.lr_find_start` over `train.lr_find_steps` steps towards `train.lr_find_end`; the
loss is smoothed (an exponential moving average, beta 0.98, bias-corrected: fastai's) and the test stops once
the smoothed loss passes 4x its minimum or is not finite (diverged). The pick is fastai's `lr_min`: the lr at
the smoothed loss's minimum, divided by 10 (the minimum itself is already at the edge of divergence). The
steepest-descent lr is recorded beside it.

The test leaves no trace in the run: its model and optimizer are its own and are dropped; every RNG (python,
numpy, torch, CUDA) is restored afterwards; the data sampler is a pure function of (seed, step); fp16's loss
scale is put back. The run then builds its model from the seed as a plain run at that lr would, so its
training is bitwise that run's (tests/test_lr_find.py). `lr_find.json` holds the curve and the pick, and a
rerun in the same directory (a resume, a requeue) reads it instead of testing again.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from llmexp.rundir.files import write_json_atomic
from llmexp.rundir.read import load_json

if TYPE_CHECKING:
    from llmexp.train.runtime import Runtime

SMOOTHING = 0.98
DIVERGED_FACTOR = 4.0
RULE = ("the lr at the minimum of the smoothed loss, divided by 10 (Smith 2015, section 3.3; fastai's lr_find "
        "`minimum` suggestion)")


@contextmanager
def rng_untouched(device: torch.device) -> Any:
    """Every RNG the run draws from is as it was before (python, numpy, torch CPU and the device's)."""
    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def lr_at(step: int, steps: int, start: float, end: float) -> float:
    return start * (end / start) ** (step / max(1, steps - 1))


def smooth(losses: list[float]) -> list[float]:
    """fastai's bias-corrected exponential moving average."""
    avg, out = 0.0, []
    for i, loss in enumerate(losses, start=1):
        avg = SMOOTHING * avg + (1 - SMOOTHING) * loss
        out.append(avg / (1 - SMOOTHING ** i))
    return out


def suggest(lrs: list[float], smoothed: list[float]) -> dict[str, Any]:
    """The pick (the minimum's lr / 10), the minimum, and the steepest descent (the most negative slope of the
    smoothed loss against log lr), over the finite part of the curve."""
    finite = [i for i, v in enumerate(smoothed) if math.isfinite(v)]
    best = min(finite, key=lambda i: smoothed[i])
    slopes = [(smoothed[i + 1] - smoothed[i]) / (math.log(lrs[i + 1]) - math.log(lrs[i]))
              for i in finite if i + 1 in finite and i < best]
    steepest = lrs[min(range(len(slopes)), key=slopes.__getitem__)] if slopes else None
    return {"suggestion": lrs[best] / 10, "lr_min_loss": lrs[best], "min_smoothed_loss": smoothed[best],
            "lr_steepest": steepest}


def range_test(cfg: DictConfig, rt: Runtime, train_ds: Any, vocab_size: int,
               forward_backward: Callable[..., tuple[torch.Tensor, int, int]]) -> dict[str, Any]:
    """Run the test on a throwaway model; the curve and the pick (every rank gets the same)."""
    from llmexp.model import build
    from llmexp.model.loss import CausalLMLoss
    from llmexp.train.state import LoopState

    t, start_s = cfg.train, time.perf_counter()
    steps, first, last = int(t.lr_find_steps), float(t.lr_find_start), float(t.lr_find_end)
    scaler_state = rt.engine.scaler_state()
    curve: list[dict[str, Any]] = []
    stopped = "reached train.lr_find_end"
    with rng_untouched(rt.device):
        torch.manual_seed(cfg.seed)
        model = rt.engine.shard(CausalLMLoss(build.build_model(cfg, vocab_size, rt.precision)))
        optimizer = build.build_optimizer(cfg, model, first, rt.device.type)
        model, optimizer = rt.engine.prepare(model, optimizer)
        state = LoopState()
        for step in range(steps):
            lr = lr_at(step, steps, first, last)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum, n_targets, _ = forward_backward(rt, model, train_ds, state)
            rt.engine.unscale_and_clip(model, optimizer, t.max_grad_norm)
            loss = float(rt.reduce_sum(loss_sum) / n_targets)
            curve.append({"step": step, "lr": lr, "loss": loss})
            smoothed = smooth([c["loss"] for c in curve])
            curve[-1]["smoothed"] = smoothed[-1]
            _say(rt, f"lr_find {step:>4} | lr {lr:.3e} | loss {loss:.4f} | smoothed {smoothed[-1]:.4f}")
            if not math.isfinite(smoothed[-1]) or smoothed[-1] > DIVERGED_FACTOR * min(smoothed):
                stopped = f"diverged at step {step} (smoothed loss above {DIVERGED_FACTOR:g}x its minimum)"
                break
            if rt.engine.scaler is not None:
                rt.engine.scaler_step(optimizer)
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
        del model, optimizer
    rt.engine.load_scaler_state(scaler_state)
    if len(curve) < 3:
        from llmexp.errors import UserError

        raise UserError(f"lr=find: the loss diverged within {len(curve)} steps of train.lr_find_start="
                        f"{first:g}; lower train.lr_find_start (e.g. 1e-8) or check the data")
    picked = suggest([c["lr"] for c in curve], [c["smoothed"] for c in curve])
    return {"rule": RULE, **picked, "stopped": stopped, "steps_run": len(curve), "lr_find_steps": steps,
            "lr_find_start": first, "lr_find_end": last, "seconds": round(time.perf_counter() - start_s, 2),
            "curve": curve}


def _say(rt: Runtime, line: str) -> None:
    if rt.is_main:
        print(line, file=sys.stderr, flush=True)


def _same_test(saved: dict[str, Any] | None, cfg: DictConfig) -> bool:
    t = cfg.train
    return bool(saved) and "suggestion" in saved and all(  # type: ignore[operator]
        saved.get(k) == v for k, v in (("lr_find_steps", t.lr_find_steps), ("lr_find_start", t.lr_find_start),
                                       ("lr_find_end", t.lr_find_end)))  # type: ignore[union-attr]


def found_lr(cfg: DictConfig, rt: Runtime, train_ds: Any, vocab_size: int,
             forward_backward: Callable[..., tuple[torch.Tensor, int, int]]) -> dict[str, Any]:
    """lr_find.json's result: read back from an earlier launch in this directory, else tested now (and
    lr_find.json and lr_find.png written by rank 0)."""
    path = rt.run_dir / "lr_find.json"
    saved = load_json(path)
    if _same_test(saved, cfg):
        _say(rt, f"lr_find: reusing {path}: lr {saved['suggestion']:.4g}")  # type: ignore[index]
        return saved  # type: ignore[return-value]
    result = range_test(cfg, rt, train_ds, vocab_size, forward_backward)
    if rt.is_main:
        write_json_atomic(path, result)
        try:
            from llmexp.report.lr_find import plot_lr_find

            plot_lr_find(result, rt.run_dir / "lr_find.png")
        except Exception as err:  # a plotting problem must not lose the result
            _say(rt, f"warning: could not plot lr_find.png: {err!r}")
    _say(rt, f"lr_find: suggested lr {result['suggestion']:.4g} ({result['stopped']}; minimum at "
             f"{result['lr_min_loss']:.3g}); {path}")
    return result


def with_lr(cfg: DictConfig, found: dict[str, Any]) -> DictConfig:
    """The config to train with: `lr` set to the pick (what a plain run at that lr has)."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    OmegaConf.set_struct(out, True)
    with open_dict(out):
        out.lr = float(found["suggestion"])
    return out
