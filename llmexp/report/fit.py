"""`python -m llmexp.fit SWEEP_DIR [SWEEP_DIR ...] [--target-params N] [--out DIR]`: the best lr per model size
from the jobs of finished sweeps, and the power law that carries it across sizes. What it fits, prints and writes
(fit.json, fit.png): docs/tutorials/tune-small-train-big.md, section 4; exit codes: docs/reference/commands.md. Reads
run directories only through `llmexp.rundir.read`; no torch.

Every x is a natural log (of an lr, a batch size, a parameter count): a loss is close to a parabola in log(lr) near
its minimum (and far from one away from it: a too-high lr diverges steeply, a too-low one rises slowly), and an
optimum that scales with size is a straight line in log-log.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llmexp.errors import EXIT_OK, EXIT_USER, UserError
from llmexp.machine.paths import dir_out_problem
from llmexp.report.formats import fmt, fmt_params
from llmexp.rundir import read
from llmexp.rundir.files import write_json_atomic

WINDOW_DECADES = 0.5
"""The parabola is fitted through the grid's minimum and its neighbours within this many decades of it (always the
two nearest, so a coarse grid still fits): near enough that the loss is parabolic in log(lr). A loss curve is skewed
(steep below the optimum, flat above it): fitted over a whole decade of a factor-2 grid, the vertex landed 2x above
the grid's best (benchmarks/transfer.py, 2-core AMD EPYC Zen 3); half a decade keeps a factor-2 or 3x grid to the
minimum and its two neighbours, and a sqrt(2) grid to seven points."""
DRAWS = 2000
"""Bootstrap draws: the 2.5% and 97.5% percentiles move by well under a grid step between seeds at this count."""
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}
"""Student's t, two-sided 95%, by degrees of freedom (between entries: the next lower dof's, the wider one)."""


def t975(dof: int) -> float:
    return T975[max(k for k in T975 if k <= dof)] if dof <= 30 else 1.96


@dataclass
class Vertex:
    """The minimum of a loss curve over one swept axis (x = log of the value)."""

    grid_best: float
    """The x of the lowest loss on the grid."""
    window: list[int]
    """Indices of the points the parabola was fitted through."""
    edge: str | None = None
    """`low` or `high`: the grid's minimum is its lowest or highest value; None inside."""
    coef: list[float] | None = None
    """The parabola, highest power first (np.polyval); None without a fit."""
    x_best: float | None = None
    """The vertex's x; None where there is none (the minimum at the grid's edge, or no convex fit)."""
    interval: tuple[float, float] | None = None
    """95% interval of x_best (`vertex`); None when the points give no noise estimate."""
    sigma: float | None = None
    """The noise of one point's loss the interval assumed, and where it came from."""
    sigma_source: str | None = None
    draws: np.ndarray | None = field(default=None, repr=False)
    """The bootstrap's vertices (for the law's interval across sizes); not written out."""

    def in_units(self) -> tuple[float | None, list[float] | None, float]:
        """x_best, its interval and grid_best as swept values (not their logs)."""
        best = None if self.x_best is None else math.exp(self.x_best)
        return best, [math.exp(x) for x in self.interval] if self.interval else None, math.exp(self.grid_best)


def noise_sigma(ys: list[float], coef: np.ndarray, xs: list[float],
                replicates: list[list[float]] | None) -> tuple[float | None, str | None]:
    """The noise of the (mean) loss at one point: pooled over replicate seeds where a point has several runs (per run;
    the caller divides by sqrt(runs)), else the fit's residuals when there are more points than the parabola's 3
    coefficients; None otherwise (3 points fit exactly: they say nothing about their noise)."""
    groups = [r for r in (replicates or []) if len(r) > 1]
    if groups:
        dof = sum(len(r) - 1 for r in groups)
        ss = sum(float(np.sum((np.asarray(r) - np.mean(r)) ** 2)) for r in groups)
        return math.sqrt(ss / dof), "replicate seeds"
    if len(xs) > 3:
        resid = np.asarray(ys) - np.polyval(coef, np.asarray(xs))
        return math.sqrt(float(np.sum(resid ** 2)) / (len(xs) - 3)), "fit residuals"
    return None, None


def _minimisers(coef: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """The x in [lo, hi] where each parabola (columns of `coef`) is lowest: its vertex when convex (clipped to
    the range), else the lower end point."""
    a, b = coef[0], coef[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        vertex = np.clip(-b / (2 * a), lo, hi)
    ends = np.where(np.polyval(coef, lo) <= np.polyval(coef, hi), lo, hi)
    return np.where(a > 0, vertex, ends)


def vertex(xs: list[float], ys: list[float], runs: list[int] | None = None,
           replicates: list[list[float]] | None = None, seed: int = 0) -> Vertex:
    """The x minimising a parabola fitted (least squares) through the points near the grid's minimum, with a 95%
    interval. `xs` ascending and distinct, `ys` the mean loss at each, `runs` how many runs each mean is of,
    `replicates` each point's individual losses (for the noise estimate).

    The interval is a parametric bootstrap (each fitted point's loss redrawn as the parabola's value there plus
    Gaussian noise of `noise_sigma` / sqrt(runs), the parabola refitted and minimised: `_minimisers`) rather than
    the delta method, because the vertex, -b / 2a, is far from linear in the fit when a is small."""
    i_min = int(np.argmin(ys))
    edge = "low" if i_min == 0 else "high" if i_min == len(xs) - 1 else None
    if edge is not None or len(xs) < 3:
        return Vertex(xs[i_min], [i_min], edge)
    reach = WINDOW_DECADES * math.log(10)  # the minimum's immediate neighbours, and any further points within it
    window = [i for i in range(len(xs)) if abs(i - i_min) <= 1 or abs(xs[i] - xs[i_min]) <= reach + 1e-12]
    wx, wy = [xs[i] for i in window], [ys[i] for i in window]
    coef = np.polyfit(wx, wy, 2)
    v = Vertex(xs[i_min], window, coef=coef.tolist())
    if coef[0] <= 0:  # a noisy grid whose lowest point is inside but the curve around it is not convex
        return v
    x_best = float(-coef[1] / (2 * coef[0]))
    if not wx[0] <= x_best <= wx[-1]:  # extrapolated past the points: the grid has not bracketed the optimum
        v.edge = "low" if x_best < wx[0] else "high"
        return v
    v.x_best = x_best
    v.sigma, v.sigma_source = noise_sigma(wy, coef, wx, [replicates[i] for i in window] if replicates else None)
    if not v.sigma:
        return v
    per_point = v.sigma / np.sqrt(np.asarray([runs[i] for i in window] if runs else [1] * len(window), dtype=float))
    rng = np.random.default_rng(seed)
    ys_star = np.polyval(coef, np.asarray(wx))[:, None] + per_point[:, None] * rng.standard_normal((len(wx), DRAWS))
    v.draws = _minimisers(np.polyfit(wx, ys_star, 2), wx[0], wx[-1])
    lo, hi = np.percentile(v.draws, [2.5, 97.5])
    v.interval = (float(lo), float(hi))
    return v


@dataclass
class PowerLaw:
    """y = a * n^b, fitted by least squares in log-log."""

    a: float
    b: float
    b_interval: tuple[float, float] | None
    interval_method: str | None
    points: int
    log_a: float = field(repr=False, default=0.0)
    cov: np.ndarray | None = field(repr=False, default=None)
    """The covariance of (b, log a) from the least squares (`np.polyfit(cov=True)`; 3+ points)."""
    draws: np.ndarray | None = field(repr=False, default=None)
    """(intercepts, slopes) of the law refitted to each bootstrap draw of the vertices."""

    def at(self, n: float) -> tuple[float, tuple[float, float] | None]:
        """The law's value at `n` with a 95% interval (of the law's mean there, not of one more run)."""
        x = math.log(n)
        log_y = self.log_a + self.b * x
        if self.cov is not None:
            half = t975(self.points - 2) * math.sqrt(float(np.array([x, 1.0]) @ self.cov @ np.array([x, 1.0])))
            return math.exp(log_y), (math.exp(log_y - half), math.exp(log_y + half))
        if self.draws is not None:
            lo, hi = np.percentile(self.draws[0] + self.draws[1] * x, [2.5, 97.5])
            return math.exp(log_y), (math.exp(lo), math.exp(hi))
        return math.exp(log_y), None


def power_law(log_n: list[float], log_y: list[float], draws: list[np.ndarray | None] | None = None) -> PowerLaw:
    """log y = log a + b log n by least squares. The interval on b (95%): from 3 points on, the slope's standard
    error with Student's t (the scatter about the line holds every source of noise, the vertices' included); with
    2 points the line goes through both, so it is the spread of slopes refitted to the vertices' own bootstrap
    draws (`draws`, one array per point or None for a point without one); None when no point has draws."""
    x, y = np.asarray(log_n, dtype=float), np.asarray(log_y, dtype=float)
    (b, log_a), cov = np.polyfit(x, y, 1, cov=True) if len(x) >= 3 else (np.polyfit(x, y, 1), None)
    law = PowerLaw(math.exp(log_a), float(b), None, None, len(x), float(log_a), cov)
    if cov is not None:
        half = t975(len(x) - 2) * math.sqrt(cov[0, 0])
        law.b_interval, law.interval_method = (float(b - half), float(b + half)), "ols t interval"
    elif draws and any(d is not None for d in draws):
        ys_star = np.stack([d if d is not None else np.full(DRAWS, v) for d, v in zip(draws, y, strict=True)])
        slopes, intercepts = np.polyfit(x, ys_star, 1)
        law.draws = np.stack([intercepts, slopes])
        lo, hi = np.percentile(slopes, [2.5, 97.5])
        law.b_interval, law.interval_method = (float(lo), float(hi)), "bootstrap of the vertices"
    return law


def grid_step(values: list[float]) -> float:
    """The median ratio between neighbouring distinct grid values: the grid's resolution."""
    vs = sorted(set(values))
    return float(np.median([b / a for a, b in itertools.pairwise(vs)])) if len(vs) > 1 else 1.0


# ----------------------------------------------------------------------------- the jobs of the sweeps

DEEPSEEK_LLM = {"lr": {"a": 0.3118, "b": -0.1250}, "batch_tokens": {"a": 0.2920, "b": 0.3271}}
"""DeepSeek LLM (2024, arXiv:2401.02954, section 3.1): eta_opt = 0.3118 * C^-0.1250 and B_opt = 0.2920 * C^0.3271
(tokens per step), C the compute in FLOPs."""


@dataclass
class Job:
    """What the fit needs of one finished job."""

    dir: Path
    params: int
    lr: float
    loss: float | None
    """The final eval loss; None for a job that diverged (a lr too high: the curve's upper wall)."""
    batch: int
    """Sequences per optimizer step (global_batch_size)."""
    context: int
    tokens: float
    """Tokens seen: steps x global batch x context (an upper bound for padded, unpacked data)."""
    parametrization: str
    mup_base: str = ""
    """muP's base model, in overrides (`model.mup_base_width=64 ...`): an lr transfers from one base only."""


def _damaged(path: Path, why: str) -> UserError:
    return UserError(f"{path}: {why}; run that job again, or move {path.parent} out of the sweep directory to fit "
                     "without it")


def read_job(job_dir: Path) -> Job | str:
    """A finished job of a sweep, or why it is left out. A summary.json that is there but unreadable is an error
    (its reader said what is wrong with it): fitting without it would quietly move the optimum."""
    summary_path, summary = job_dir / "summary.json", read.load_summary(job_dir)
    if read.summary_damaged(job_dir, summary):
        raise _damaged(summary_path, "damaged (the line above says how)")
    if summary is None:
        return "no summary.json (running, killed or crashed)"
    status = read.load_job_status(job_dir).get("status") or summary.get("status")
    if status not in (*read.FINISHED, "diverged"):
        return f"status {status}"
    start = next((r for r in read.load_records(job_dir) if r.get("event") == "start"), {})
    params = start.get("model_params", summary.get("total_params"))
    lr = summary.get("lr", start.get("lr_chosen"))
    batch, context, step = summary.get("global_batch_size"), start.get("max_length"), summary.get("step")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in (params, lr, batch, context)):
        raise _damaged(summary_path, "it (with metrics.jsonl's start record) names no model_params, lr, "
                                     "global_batch_size or max_length")
    loss = summary.get("eval_loss")
    diverged = status == "diverged" or (isinstance(loss, float) and not math.isfinite(loss))
    if loss is None and not diverged:
        return "no eval loss (train.eval_steps off?)"
    # model.parametrization is newer than some runs, which were all trained in the standard parametrization
    cfg = read.load_config(job_dir)
    parametrization = read.config_value(cfg, "model.parametrization")
    mup = parametrization == "mup"
    base = " ".join(f"model.{k}={read.config_value(cfg, f'model.{k}')}" for k in MUP_BASE) if mup else ""
    return Job(job_dir, int(params), float(lr), None if diverged else float(loss), int(batch), int(context),
               float(step or 0) * batch * context, parametrization if isinstance(parametrization, str) else "standard",
               base)


MUP_BASE = ("mup_base_width", "mup_input_mult", "mup_output_mult")
"""The model.* keys that make muP's base model: its lr is what transfers to the widths."""


def collect(sweep_dirs: list[Path]) -> tuple[list[Job], list[dict[str, str]]]:
    """The finished jobs of every sweep directory, and the others with why they are left out."""
    jobs: list[Job] = []
    left_out: list[dict[str, str]] = []
    for sweep in dict.fromkeys(sweep_dirs):  # a directory given twice: its jobs count once, not as seeds
        if not read.is_sweep_dir(sweep):
            raise UserError(f"{sweep} is not a sweep directory (no multirun.yaml, no job subdirectories); point "
                            "llmexp.fit at the directory `python -m llmexp --multirun` wrote (hydra.sweep.dir)")
        outcomes = [(job_dir, read_job(job_dir)) for job_dir in read.job_dirs(sweep)]
        jobs += [job for _, job in outcomes if isinstance(job, Job)]
        left_out += [{"job": str(job_dir), "why": job} for job_dir, job in outcomes if isinstance(job, str)]
    if jobs and all(j.loss is None for j in jobs):
        raise UserError(f"every finished job in {', '.join(map(str, sweep_dirs))} diverged: sweep lower lrs (the "
                        f"lowest here, {min(j.lr for j in jobs):.3g}, is still too high)")
    if not jobs:
        raise UserError(f"no finished job with an eval loss in {', '.join(map(str, sweep_dirs))}; wait for the "
                        f"sweep to end (python -m llmexp.status {sweep_dirs[0]}), or run it again to finish it")
    return jobs, left_out


# ----------------------------------------------------------------------------- one size

def _advice(axis: str, edge: str | None, best: float, above: list[float]) -> str | None:
    """What to do about a minimum at the grid's edge."""
    if edge == "high" and above:  # a higher lr diverged: the optimum lies between the two
        return f"{axis} grid too narrow: add {axis}s between {best:.3g} and {min(above):.3g}, which diverged"
    if edge == "low":
        return f"{axis} grid too narrow, extend it down (its best is its lowest, {best:.3g})"
    return f"{axis} grid too narrow, extend it up (its best is its highest, {best:.3g})" if edge else None


def lr_fit(jobs: list[Job], where: str) -> tuple[dict[str, Any], Vertex]:
    """The best lr of one size's jobs (one batch size): the points, the parabola and its vertex."""
    lrs = sorted({j.lr for j in jobs if j.loss is not None})
    reps = [[j.loss for j in jobs if j.lr == lr and j.loss is not None] for lr in lrs]  # each lr's runs (seeds, sweeps)
    if len(lrs) < 3:
        raise UserError(f"{where}: {len(lrs)} lr(s) with an eval loss ({', '.join(f'{lr:.3g}' for lr in lrs)}); a "
                        "parabola needs at least 3: sweep lr at this size over 3 or more values ~3x apart around "
                        "the expected best (e.g. lr=1e-3,3e-3,1e-2)")
    losses, runs = [float(np.mean(r)) for r in reps], [len(r) for r in reps]
    v = vertex([math.log(lr) for lr in lrs], losses, runs, reps)
    diverged = sorted({j.lr for j in jobs if j.loss is None})
    best, interval, grid_best = v.in_units()
    advice = _advice("lr", v.edge, grid_best, [d for d in diverged if d > grid_best])
    if v.edge is None and v.x_best is None:
        advice = "the losses around the grid's best are not convex (noise?): add seeds or a finer grid"
    points = [{"lr": lr, "loss": loss, "runs": n} for lr, loss, n in zip(lrs, losses, runs, strict=True)]
    return {"points": points, "diverged_lrs": diverged, "fitted": [lrs[i] for i in v.window], "coef": v.coef,
            "best_lr": best, "interval": interval, "noise": v.sigma, "noise_from": v.sigma_source,
            "grid_best_lr": grid_best, "edge": v.edge, "advice": advice}, v


def batch_fit(jobs: list[Job]) -> tuple[dict[str, Any] | None, list[Job]]:
    """Where batch_size was swept at this size: the best batch (a parabola in log(batch) through each batch's best
    loss over its lrs), and the jobs at the grid's best batch, whose lrs the lr fit uses (the best lr moves with the
    batch). Without a batch sweep: None and every job."""
    batches = sorted({j.batch for j in jobs if j.loss is not None})
    if len(batches) < 2:
        return None, jobs
    best_loss = [min(j.loss for j in jobs if j.batch == b and j.loss is not None) for b in batches]
    v = vertex([math.log(b) for b in batches], best_loss)
    best, interval, _ = v.in_units()
    grid_best = batches[int(np.argmin(best_loss))]
    context = jobs[0].context
    fit = {"points": [{"batch": b, "best_loss": loss} for b, loss in zip(batches, best_loss, strict=True)],
           "best_batch": best, "interval": interval, "grid_best_batch": grid_best, "edge": v.edge, "context": context,
           "best_batch_tokens": None if best is None else best * context,
           "advice": _advice("batch_size", v.edge, grid_best, []) if len(batches) > 2 else
           "2 batch sizes: the best is the grid's, without a vertex; sweep 3 or more"}
    return fit, [j for j in jobs if j.batch == grid_best]


def deepseek(params: float, tokens: float) -> dict[str, float]:
    """DeepSeek LLM's optimal lr and batch (tokens) at the compute C ~ 6 N D of `params` trained on `tokens`."""
    compute = 6.0 * params * tokens
    return {"compute": compute, **{what: law["a"] * compute ** law["b"] for what, law in DEEPSEEK_LLM.items()}}


def size_fit(params: int, jobs: list[Job], seed_lr: Callable[[float], float] | None) -> tuple[dict[str, Any], Vertex]:
    batch, at_batch = batch_fit(jobs)
    where = f"the {fmt_params(params)}-parameter jobs ({jobs[0].dir.parent}" + \
        (f", batch {at_batch[0].batch})" if batch else ")")
    lr, v = lr_fit(at_batch, where)
    tokens = float(np.median([j.tokens for j in at_batch]))
    return {"params": params, "jobs": len(jobs), "tokens_seen": tokens, "batch_size": at_batch[0].batch, **lr,
            "batch": batch, "deepseek": deepseek(params, tokens),
            "seed_table_lr": seed_lr(params) if seed_lr else None}, v


# ----------------------------------------------------------------------------- across sizes

def fit_law(what: str, points: list[tuple[float, float, np.ndarray | None]], why_none: str
            ) -> tuple[PowerLaw | None, dict[str, Any]]:
    """`what` = a * N^b over each size's (N, log of its best, that best's bootstrap draws or None), and fit.json's
    entry for it: why there is none with fewer than 2 sizes."""
    if len(points) < 2:
        return None, {"fitted": False, "why": why_none}
    law = power_law([math.log(n) for n, _, _ in points], [y for _, y, _ in points], [d for _, _, d in points])
    return law, {"fitted": True, "formula": f"{what} = a * N^b", "a": law.a, "b": law.b,
                 "b_interval": law.b_interval, "interval_method": law.interval_method, "sizes": law.points}


def mup_transfer(sizes: list[dict], jobs: list[Job]) -> dict[str, Any]:
    """Under muP the best lr should not move with size: by what factor it did, against the grid's resolution (a
    move within one grid step is what the grid can see as flat)."""
    best = [s["best_lr"] for s in sizes if s["best_lr"] is not None]
    step = grid_step([j.lr for j in jobs])
    if len(best) < 2:
        fix = "fix the edge flags above" if len(sizes) > len(best) else "sweep a second width to see whether it moves"
        own = next((s["interval"] for s in sizes if s["best_lr"] is not None), None)  # the one size's, carried
        return {"moved_by": None, "grid_step": step, "flat": None, "best_lr": best[0] if best else None,
                "range": own, "note": f"{len(best)} size(s) with a best lr: nothing to compare ({fix})"}
    moved = max(best) / min(best)
    flat = moved <= step * 1.0001
    return {"moved_by": moved, "grid_step": step, "flat": flat, "best_lr": math.exp(float(np.mean(np.log(best)))),
            "range": [min(best), max(best)],
            "note": f"muP: the best lr moved by a factor {moved:.2g} across {len(best)} sizes; "
                    + (f"within one grid step (x{step:.2g}): flat, as muP intends, so it transfers" if flat else
                       f"more than one grid step (x{step:.2g}): not flat; check the sizes share the base width "
                       "and the muP settings")}


def target(n: float, law: PowerLaw | None, mup: dict[str, Any] | None) -> dict[str, Any]:
    """The lr at `n` parameters: the law's (standard), or the sizes' shared optimum (muP: it transfers)."""
    if mup is not None:
        return {"params": n, "lr": mup["best_lr"], "interval": mup["range"], "from": "muP transfer (the "
                "geometric mean of the sizes' best lrs; interval: their range, or the one size's own)"}
    if law is None:
        return {"params": n, "lr": None, "interval": None, "from": "no law fitted"}
    lr, interval = law.at(n)
    return {"params": n, "lr": lr, "interval": list(interval) if interval else None, "from": "the power law"}


def fit_sweeps(sweep_dirs: list[Path], target_params: float | None = None,
               seed_lr: Callable[[float], float] | None = None) -> dict[str, Any]:
    """fit.json's content; raises UserError on input it cannot fit."""
    jobs, left_out = collect(sweep_dirs)
    kinds = sorted({j.parametrization for j in jobs})
    if len(kinds) > 1:
        raise UserError(f"the jobs mix model.parametrization={' and '.join(kinds)}; their best lrs follow different "
                        "rules: fit each parametrization's sweeps separately")
    if len(bases := sorted({j.mup_base for j in jobs})) > 1:
        raise UserError(f"the muP jobs mix base models ({'; '.join(bases)}); an lr transfers from the base it was "
                        "tuned at: fit each base's sweeps separately")
    try:
        fits = [size_fit(n, [j for j in jobs if j.params == n], seed_lr) for n in sorted({j.params for j in jobs})]
    except UserError as err:  # too few lrs: perhaps because some jobs have not finished
        if not left_out:
            raise
        first = left_out[0]
        raise UserError(f"{err}. {len(left_out)} job(s) were left out, e.g. {first['job']}: {first['why']}; a sweep "
                        "that has not finished continues with its own command") from None
    sizes, vertices = [f[0] for f in fits], [f[1] for f in fits]
    mup = mup_transfer(sizes, jobs) if kinds == ["mup"] else None
    # an edge has no vertex: its best lr is only bounded
    best_lrs = [(s["params"], v.x_best, v.draws) for s, v in zip(sizes, vertices, strict=True) if v.x_best is not None]
    why = "muP: the best lr is not expected to scale with size" if mup else \
        f"{len(best_lrs)} size(s) with a best lr; a law needs 2 or more (fix the edge flags above)"
    law, lr_law = fit_law("best_lr", [] if mup else best_lrs, why)
    best_batches = [(s["params"], math.log(s["batch"]["best_batch"]), None) for s in sizes
                    if s["batch"] and s["batch"]["best_batch"] is not None]
    _, batch_law = fit_law("best_batch", best_batches,
                           "batch_size was not swept at 2 or more sizes with a best batch inside the grid")
    return {"sweep_dirs": [str(d) for d in sweep_dirs], "loss": "final eval_loss (mean over runs at one lr)",
            "parametrization": kinds[0], "sizes": sizes, "lr_law": lr_law, "batch_law": batch_law, "mup": mup,
            "target": target(target_params, law, mup) if target_params else None,
            "deepseek_llm": {**DEEPSEEK_LLM, "against": "compute C ~ 6 * N * D in FLOPs, D the tokens the jobs saw"},
            "left_out": left_out}


# ----------------------------------------------------------------------------- the command

def _interval(values: list[float] | tuple[float, float] | None) -> str:
    return f"[{fmt(values[0], 2)}, {fmt(values[1], 2)}]" if values else "[no interval: 3 points fit exactly]"


def table(result: dict[str, Any]) -> str:
    """The printed summary: a row per size, the law, the target."""
    rows = [f"{'size':<5} {'params':>8}  {'best lr [95% interval]':<44} {'points':>6}  edge"]
    for i, s in enumerate(result["sizes"], 1):
        best = f"{fmt(s['best_lr'], 3)} {_interval(s['interval'])}" if s["best_lr"] else \
            f"– (grid's best {fmt(s['grid_best_lr'], 3)})"
        rows.append(f"{i:<5} {fmt_params(s['params']):>8}  {best:<44} {len(s['points']):>6}  {s['advice'] or '–'}")
        if b := s["batch"]:
            rows.append(f"{'':<5} {'':>8}  best batch {fmt(b['best_batch'], 3)} (grid's {b['grid_best_batch']}; lrs "
                        f"fitted at it)  {b['advice'] or ''}")
    rows.append(_law_line("lr", result["lr_law"]))
    if result["batch_law"]["fitted"]:
        rows.append(_law_line("batch", result["batch_law"]))
    if result["mup"]:
        rows.append(result["mup"]["note"])
    if t := result["target"]:
        interval = _interval(t["interval"]) if t["interval"] else "[no interval]"  # (not "3 points fit exactly")
        rows.append(f"at N = {fmt_params(t['params'])}: lr {fmt(t['lr'], 3)} {interval} ({t['from']})"
                    if t["lr"] else f"at N = {fmt_params(t['params'])}: no lr ({t['from']})")
    if result["left_out"]:
        rows.append(f"left out: {len(result['left_out'])} job(s) (fit.json's left_out says why)")
    return "\n".join(rows)


def _law_line(what: str, law: dict[str, Any]) -> str:
    if not law["fitted"]:
        return f"{what} law: none ({law['why']})"
    interval = (f", b in [{law['b_interval'][0]:.3g}, {law['b_interval'][1]:.3g}] ({law['interval_method']})"
                if law["b_interval"] else ", no interval on b")
    return f"{what} law: best_{what} = {law['a']:.3g} * N^{law['b']:.3f}{interval}; {law['sizes']} sizes"


def parse_count(text: str) -> float:
    """A parameter count: 1e9, 1000000000, 7B, 125M, 1.5T."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(text[-1:].upper(), 1.0)
    try:
        value = float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        # argparse prints this message (a ValueError would show only the function's name)
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count: write e.g. 7e9, 7B or 125M")
    return value


def main(argv: list[str] | None = None, seed_lr: Callable[[float], float] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmexp.fit",
                                     description="The best lr per model size, and its power law across sizes.")
    parser.add_argument("sweep_dirs", type=Path, nargs="+", metavar="SWEEP_DIR", help="finished sweep directories")
    parser.add_argument("--target-params", type=parse_count, metavar="N",
                        help="extrapolate the best lr to N parameters (1e9, 7B, 125M)")
    parser.add_argument("--out", type=Path, metavar="DIR", help="where fit.json and fit.png go (the first SWEEP_DIR)")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]  # (a directory named in bytes)
    out = args.out or args.sweep_dirs[0]
    try:
        if problem := dir_out_problem("--out", out):  # mkdir would say only "File exists"
            raise UserError(problem)
        result = fit_sweeps(args.sweep_dirs, args.target_params, seed_lr)
        out.mkdir(parents=True, exist_ok=True)
        result["files"] = {"json": str(out / "fit.json"), "png": str(out / "fit.png")}
        from llmexp.report.fit_plot import plot_fit

        plot_fit(result, out / "fit.png", seed_lr)
        write_json_atomic(out / "fit.json", result)
    except UserError as err:
        print(f"llmexp.fit: error: {err}", file=sys.stderr)
        return EXIT_USER
    except OSError as err:  # (the sweeps are read through the readers: what fails here is the writing)
        print(f"llmexp.fit: error: --out {out}: cannot write there ({err.strerror or err}); pick another --out",
              file=sys.stderr)
        return EXIT_USER
    print(table(result))
    print(f"wrote {result['files']['json']} and {result['files']['png']}")
    return EXIT_OK
