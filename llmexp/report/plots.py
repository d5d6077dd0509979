"""Pictures for the reports: a run's curves with its findings marked, a sweep's overlaid curves, a search's
history, the lr range test and muP's coordinate check; and `figure`, the skeleton every picture (fit_plot's too)
is drawn in. matplotlib (Agg backend) is imported inside the functions, so importing this module costs nothing."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from llmexp.monitor.detectors import MonitorSettings
from llmexp.report.findings import finding_state
from llmexp.report.formats import is_finite
from llmexp.rundir import read
from llmexp.rundir.files import atomic_file
from llmexp.rundir.task_metrics import task_history, task_records

SEVERITY_COLOURS = {"error": "#d62728", "warning": "#ff7f0e", "info": "#7f7f7f"}


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def figure(path: Path, title: str, shape: tuple[int, int], panel_in: tuple[float, float],
           caption: list[str] | None = None, caption_style: dict | None = None, **subplots: Any) -> Iterator[list]:
    """A figure of `shape` (rows, columns) gridded panels, each `panel_in` (width, height) inches: yields their
    axes, row by row. On leaving: `title` above (a directory's name whose bytes are not UTF-8 escaped, as Python
    prints them), `caption`'s lines below the panels, and the PNG written to a temporary name and renamed, so a
    reader never sees half of one; the figure is closed either way.

    With a caption the margins are fixed, its room reserved below the panels: tight_layout and a tight bounding box
    would lay the figure out three times, ~1 s of CPU at the end of every run (measured on a 2-core AMD Zen 3)."""
    plt = pyplot()
    rows, cols = shape
    caption_in = 0.3 + 0.14 * len(caption) if caption else 0.0
    height_in = rows * panel_in[1] + caption_in
    fig, grid = plt.subplots(rows, cols, figsize=(cols * panel_in[0], height_in), squeeze=False, **subplots)
    try:
        axes = list(grid.flat)
        for ax in axes:
            ax.grid(alpha=0.25, which="both")
        yield axes
        fig.suptitle(title.encode("utf-8", "backslashreplace").decode(), fontsize=11)
        if caption:
            fig.subplots_adjust(left=0.07, right=0.98, top=1 - 0.55 / height_in,
                                bottom=(caption_in + 0.5) / height_in, hspace=0.3, wspace=0.28)
            fig.text(0.01, (caption_in - 0.1) / height_in, "\n".join(caption), fontsize=8, va="top",
                     **(caption_style or {}))
        else:
            fig.tight_layout()
        with atomic_file(Path(path), "wb") as f:
            fig.savefig(f, format="png", dpi=110, bbox_inches=None if caption else "tight")
    finally:
        plt.close(fig)


def _finite_xy(points: Iterable[tuple[Any, Any]]) -> tuple[list[int], list[float]]:
    """The points with a finite y, as the x and y lists `ax.plot` takes."""
    pairs = [(int(x), float(y)) for x, y in points if is_finite(y)]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _xy(records: list[dict], event: str, key: str) -> tuple[list[int], list[float]]:
    """`key` of the `event` records against the step, where finite."""
    return _finite_xy((r["step"], r.get(key)) for r in records if r.get("event") == event)


def _along_bottom(ax: Any, xs: list[int], marker: str, colour: str, label: str) -> None:
    """Markers on the bottom edge, for what has no height to place it at (a NaN, a failed trial)."""
    ax.plot(xs, [0.03] * len(xs), marker, color=colour, ms=8, mew=2, transform=ax.get_xaxis_transform(), label=label)


def _train_panel(ax: Any, records: list[dict], key: str, title: str, colour: str, label: str | None = None
                 ) -> list[float]:
    """`key` of the train records against the step (dots on a short series, where a line alone may be a single
    invisible point); returns the values drawn."""
    xs, ys = _xy(records, "train", key)
    if xs:
        ax.plot(xs, ys, lw=1.2, color=colour, label=label, marker="." if len(xs) < 30 else None)
    else:
        ax.text(0.5, 0.5, f"no {key} logged", ha="center", va="center", transform=ax.transAxes, color="#888888")
    ax.set_title(title)
    return ys


def _loss_panel(ax: Any, records: list[dict]) -> None:
    ys = _train_panel(ax, records, "loss", "loss", "#1f77b4", label="train loss")
    ex, ey = _xy(records, "eval", "eval_loss")
    ax.plot(ex, ey, "o-", ms=4, lw=1.5, color="#2ca02c", label="eval loss")
    anomalies = [r for r in records if r.get("event") == "anomaly"]
    bad = [int(r["step"]) for r in records if r.get("event") == "train" and "loss" in r and not is_finite(r["loss"])]
    bad += [int(r["step"]) for r in anomalies]
    if bad:  # drawn along the bottom edge: a NaN has no height, and a blow-up would squash the curve
        _along_bottom(ax, bad, "x", SEVERITY_COLOURS["error"], "non-finite / anomaly")
    for r in anomalies[:5]:
        value = r.get("loss")
        text = f"loss {value:.3g}" if isinstance(value, int | float) else "loss NaN"
        ax.annotate(f"{text} ({r.get('action', '?')})", xy=(int(r["step"]), 0.03), xycoords=ax.get_xaxis_transform(),
                    xytext=(6, 4), textcoords="offset points", fontsize=7, color=SEVERITY_COLOURS["error"])
    finite = ys + ey
    if finite:  # a single huge value must not flatten the rest of the curve
        lo, hi = min(finite), sorted(finite)[max(0, int(0.98 * len(finite)) - 1)]
        pad = 0.05 * (hi - lo or 1.0)
        ax.set_ylim(lo - pad, max(hi, ey[0] if ey else hi) + pad)
    ax.legend(loc="center right", fontsize=8)


def _grad_panel(ax: Any, records: list[dict], max_grad_norm: float | None) -> None:
    low, high = MonitorSettings.grad_band  # the seed's healthy band, as the detector judges it
    ax.axhspan(low, high, color="#2ca02c", alpha=0.08, label=f"seed's band {low}-{high}")
    ys = _train_panel(ax, records, "grad_norm", "grad norm", "#9467bd", label="grad norm (pre-clip)")
    if max_grad_norm:
        ax.axhline(max_grad_norm, ls="--", lw=1, color="#555555", label=f"clip at {max_grad_norm:g}")
    if ys and min(ys) > 0:
        ax.set_yscale("log")
    ax.legend(loc="upper right", fontsize=8)


def _tasks_panel(ax: Any, records: list[dict]) -> None:
    """Every task metric against the step: scores in [0, 1] on the left axis, losses on a right one."""
    twin = None
    for task, points in task_history(records).items():
        steps = [s for s, _ in points]
        for metric in points[-1][1]:
            if metric == "ppl":
                continue  # the loss says the same, on a readable scale
            if metric == "loss":
                twin = twin or ax.twinx()
            (twin if metric == "loss" else ax).plot(steps, [m.get(metric) for _, m in points], marker="o", ms=3,
                                                    ls="--" if metric == "loss" else "-", label=f"{task}/{metric}")
    ax.set_title("tasks (scores; dashed: loss, right axis)", fontsize=10)
    handles = [h for a in (ax, twin) if a is not None for h in a.get_legend_handles_labels()[0]]
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="best")


def _mark_events(axes: list[Any], records: list[dict], findings: list[dict]) -> None:
    """Vertical lines at findings (coloured by severity, numbered on the loss panel) and at rollbacks/resumes."""
    for ax in axes:
        for r in records:
            if r.get("event") in ("rollback", "resume"):
                ax.axvline(int(r["step"]), ls=":", lw=1.2, color="#17becf")
        for f in findings:
            ax.axvline(int(f["step"]), lw=1.2, alpha=0.6, color=SEVERITY_COLOURS.get(f["severity"], "#7f7f7f"))
    lo, hi = axes[0].get_xlim()
    placed: list[tuple[float, int]] = []
    for i, f in enumerate(findings, start=1):
        x = int(f["step"])
        level = sum(abs(x - px) < 0.04 * (hi - lo) for px, _ in placed)  # stagger badges that would touch
        placed.append((x, level))
        axes[0].annotate(str(i), xy=(x, 1.0), xycoords=("data", "axes fraction"), xytext=(0, -10 - 14 * level),
                         textcoords="offset points", ha="center", fontsize=7, color="white", fontweight="bold",
                         bbox={"boxstyle": "circle,pad=0.25", "fc": SEVERITY_COLOURS.get(f["severity"], "#7f7f7f"),
                               "ec": "none"})


def _findings_caption(findings: list[dict]) -> list[str]:
    """The lines under a run's curves: each finding, numbered as its badge on the loss panel."""
    if not findings:
        return ["no findings: the run looks healthy"]
    lines = [f"{i}. [{f['severity']}] {f['kind']} @ step {f['step']}{finding_state(f)}: "
             + (f["message"] if len(f["message"]) <= 110 else f["message"][:107] + "...")
             for i, f in enumerate(findings[:12], start=1)]
    return lines + ([f"... and {len(findings) - 12} more (see report.md)"] if len(findings) > 12 else [])


def plot_run(records: list[dict], findings: list[dict], path: Path, title: str = "",
             max_grad_norm: float | None = None) -> None:
    """curves.png: loss (train and eval), lr, grad norm and throughput, with findings marked; and a panel of
    the task metrics when the run scored tasks (`eval`)."""
    from matplotlib.ticker import MaxNLocator

    with_tasks = bool(task_records(records))
    worst = next((s for s in ("error", "warning", "info") if any(f["severity"] == s for f in findings)), None)
    title += f"  ·  {len(findings)} finding(s)" + (f", worst: {worst}" if worst else "")
    style = {"family": "monospace"} if findings else {"color": "#2ca02c"}
    with figure(path, title, (3 if with_tasks else 2, 2), (6, 3.75), _findings_caption(findings), style,
                sharex=True) as axes:
        panels = axes[:5] if with_tasks else axes
        if with_tasks:
            _tasks_panel(axes[4], records)
            axes[5].axis("off")
        _loss_panel(axes[0], records)
        _grad_panel(axes[1], records, max_grad_norm)
        _train_panel(axes[2], records, "lr", "learning rate", "#8c564b")
        _train_panel(axes[3], records, "tokens_per_sec", "tokens/s", "#e377c2")
        axes[2].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        _mark_events(panels, records, findings)
        for ax in panels[-2:]:  # the bottom of each column
            ax.set_xlabel("step")
            ax.xaxis.set_tick_params(labelbottom=True)
        for ax in panels:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))


# ----- sweeps ---------------------------------------------------------------------------------------

def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _ordered(values: set[str]) -> list[str]:
    """Swept values in order: numbers by value, then the rest alphabetically."""
    return sorted(values, key=lambda v: (_as_float(v) is None, _as_float(v) or 0.0, v))


def _colour_map(values: list[str]) -> dict[str, Any]:
    """A colour per swept value: a (log-)continuous scale for numbers, a qualitative one otherwise."""
    from matplotlib.colors import LogNorm, Normalize

    plt = pyplot()
    distinct = _ordered(set(values))
    nums = [_as_float(v) for v in distinct]
    if len(distinct) > 1 and all(n is not None for n in nums):
        lo, hi = min(nums), max(nums)  # type: ignore[type-var]
        norm = LogNorm(lo, hi) if lo > 0 and hi / lo >= 10 else Normalize(lo, hi)  # type: ignore[operator]
        cmap = plt.get_cmap("plasma")
        return {v: cmap(0.05 + 0.8 * float(norm(n))) for v, n in zip(distinct, nums, strict=True)}
    cmap = plt.get_cmap("tab10")
    return {v: cmap(i % 10) for i, v in enumerate(distinct)}


def _heatmap(ax: Any, jobs: list[dict], keys: list[str]) -> None:
    """Final eval loss over the first two swept parameters (best over any others)."""
    rows, cols = (_ordered({j["params"].get(k, "") for j in jobs}) for k in keys[:2])
    grid = np.full((len(rows), len(cols)), np.nan)
    failed = set()
    for j in jobs:
        r, c = rows.index(j["params"].get(keys[0], "")), cols.index(j["params"].get(keys[1], ""))
        loss = _as_float(j.get("eval_loss"))
        if loss is not None and math.isfinite(loss) and j["status"] in read.FINISHED:
            grid[r, c] = np.fmin(grid[r, c], loss)
        else:
            failed.add((r, c))
    image = ax.imshow(grid, cmap="viridis_r", aspect="auto")
    for (r, c), loss in np.ndenumerate(grid):
        text, colour = ("failed" if (r, c) in failed else "–"), "#d62728"
        if math.isfinite(loss):  # dark text on the light end of the colour map
            red, green, blue, _ = image.cmap(image.norm(loss))
            text, colour = f"{loss:.3g}", "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.5 else "white"
        ax.text(c, r, text, ha="center", va="center", fontsize=9, color=colour)
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    ax.set(xlabel=keys[1], ylabel=keys[0], title="final eval loss")
    ax.grid(False)
    ax.figure.colorbar(image, ax=ax, shrink=0.8)


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def plot_sweep(jobs: list[dict], curves: dict[str, list[dict]], varying: list[str], path: Path,
               title: str = "", recommended: str | None = None) -> None:
    """sweep_curves.png: train and eval loss of every job, coloured by the first swept parameter, marked by the
    second; a heatmap of the final eval loss when two or more vary. Unfinished jobs dashed, the recommended thick."""
    key, second = [*varying, None, None][:2]  # None where fewer vary
    colours = _colour_map([j["params"].get(key, "") if key else j["job"] for j in jobs])
    markers = {v: _MARKERS[i % len(_MARKERS)] for i, v in enumerate(_ordered({j["params"].get(second, "")
                                                                                for j in jobs}))}
    legend = f" (colour: {key}, marker: {second})" if second else f" (colour: {key})" if key else ""
    with figure(path, title, (1, 3 if second else 2), (6, 4.8)) as axes:
        for j in jobs:
            finished = j["status"] in read.FINISHED
            style = {"color": colours[j["params"].get(key, "") if key else j["job"]], "ls": "-" if finished else "--",
                     "lw": 2.6 if j["job"] == recommended else 1.2, "ms": 4,
                     "marker": markers[j["params"].get(second, "")] if second else "o"}
            label = " ".join(f"{k}={j['params'].get(k)}" for k in varying) or f"job {j['job']}"
            label += " (recommended)" if j["job"] == recommended else ("" if finished else f" [{j['status']}]")
            records = curves.get(j["job"], [])
            axes[0].plot(*_xy(records, "train", "loss"), label=label, markevery=0.2, **style)
            axes[1].plot(*_xy(records, "eval", "eval_loss"), label=label, **style)
        for ax, name in zip(axes[:2], ("train loss", "eval loss"), strict=True):
            ax.set(title=name + legend, xlabel="step")
            _clip_ylim(ax)
        _legend(axes[1], fontsize=7, loc="upper right")
        if second:
            _heatmap(axes[2], jobs, varying)


def _legend(ax: Any, **kwargs: Any) -> None:
    """The legend of what `ax` labels; none where nothing is (no job or trial has a loss yet), which matplotlib
    would warn about on the sweep's console."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def _clip_ylim(ax: Any) -> None:
    """Keep a diverged job's huge losses from flattening everyone else's curves."""
    ys = sorted(y for line in ax.get_lines() for y in line.get_ydata() if math.isfinite(y))
    if len(ys) >= 4:
        lo, hi = ys[0], ys[int(0.95 * (len(ys) - 1))]
        ax.set_ylim(lo - 0.05 * (hi - lo or 1.0), hi + 0.15 * (hi - lo or 1.0))


# ----- searches (sweep=random|tpe) ----------------------------------------------------------------

_STATE_STYLE = {"complete": ("o", "#1f77b4"), "pruned": ("X", "#ff7f0e"), "running": ("o", "#7f7f7f"),
                "fail": ("x", SEVERITY_COLOURS["error"])}
_LOSS_OF = {"complete": ("value", "complete (final eval loss)"),
            "pruned": ("last_eval_loss", "pruned (eval loss when stopped)"),
            "running": ("last_eval_loss", "running (latest eval loss)")}
"""Where a trial's loss is, by state, and its legend."""


def _trial_points(ax: Any, rows: list[dict], x_of: Callable[[dict], Any], legend: bool) -> None:
    """Each trial's loss at `x_of(trial)` (None: not drawn): a complete trial's value, filled; a pruned or running
    trial's latest eval loss, hollow."""
    for state, (key, label) in _LOSS_OF.items():
        marker, colour = _STATE_STYLE[state]
        pts = [(x_of(r), r[key]) for r in rows if r["state"] == state and x_of(r) is not None and is_finite(r[key])]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker, ls="none", color=colour, ms=7, mew=1.5,
                    mfc=colour if state == "complete" else "none", label=label if legend else None)


def _history_panel(ax: Any, rows: list[dict]) -> None:
    """Each trial's value (a pruned or running trial's latest eval loss, hollow) and the best so far."""
    from matplotlib.ticker import MaxNLocator

    _trial_points(ax, rows, lambda r: r["number"], legend=True)
    failed = [r["number"] for r in rows if r["state"] == "fail"]
    if failed:  # no loss to place
        _along_bottom(ax, failed, *_STATE_STYLE["fail"], "failed")
    best = [(r["number"], r["best_so_far"]) for r in rows if r["best_so_far"] is not None]
    if best:
        ax.step(*zip(*best, strict=True), where="post", color="#2ca02c", lw=2, label="best so far")
    ax.set(xlabel="trial", title="optimisation history")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _legend(ax, fontsize=8, loc="best")


def _trial_curves_panel(ax: Any, rows: list[dict]) -> None:
    """Every trial's eval loss by step; a pruned trial's curve ends in a marker at the step it stopped."""
    for r in rows:
        xs, ys = _finite_xy(r["curve"])
        marker, colour = _STATE_STYLE.get(r["state"], ("o", "#7f7f7f"))
        ax.plot(xs, ys, lw=1.0 if r["state"] == "complete" else 1.3, color=colour, alpha=0.6,
                ls="--" if r["state"] == "running" else "-")
        if r["state"] == "pruned" and ys:
            stop = r["stopped_step"] if r["stopped_step"] is not None else xs[-1]
            # The stop request follows the eval that decided it; the run goes on until its next step boundary.
            ax.plot([xs[-1], stop], [ys[-1], ys[-1]], ":", color=colour, lw=1)
            ax.plot([stop], [ys[-1]], marker, color=colour, ms=9)
            ax.annotate(str(r["number"]), (stop, ys[-1]), xytext=(4, 3), textcoords="offset points", fontsize=7,
                        color=colour)
    ax.plot([], [], "-", color=_STATE_STYLE["complete"][1], label="complete")
    ax.plot([], [], "-X", color=_STATE_STYLE["pruned"][1], label="pruned (X: the step it stopped at)")
    ax.set(xlabel="step", title="eval loss of each trial")
    ax.legend(fontsize=8, loc="upper right")
    _clip_ylim(ax)


def plot_search(search: dict[str, Any], path: Path, title: str = "") -> None:
    """sweep_search.png: the three panels docs/how-to/sweeps.md describes (pruned trials at their last eval loss)."""
    rows, counts = search["trials"], search["counts"]
    numeric = [k for k, v in search["space"].items() if not v.startswith("one of")]
    title += (f"  ·  {search['sampler']} + {search['pruner']}: {counts['complete']} complete, "
              f"{counts['pruned']} pruned, {counts['fail']} failed, {counts['running']} running")
    with figure(path, title, (1, 3 if numeric else 2), (6, 4.8)) as axes:
        _history_panel(axes[0], rows)
        _trial_curves_panel(axes[1], rows)
        if numeric:
            name = numeric[0]
            _trial_points(axes[2], rows, lambda r: r["params"][name] if is_finite(r["params"].get(name)) else None,
                          legend=False)
            axes[2].set(xscale="log" if search["space"][name].startswith("log") else "linear", xlabel=name,
                        title=f"eval loss by {name}")
        for ax in axes:
            ax.set_ylabel("eval loss")


# ----- the lr range test and muP's coordinate check ------------------------------------------

def plot_lr_find(result: dict[str, Any], path: Path) -> None:
    """lr_find.png: an lr range test's raw and smoothed loss against the lr (log scale), each rule's pick, the
    minimum."""
    curve = [c for c in result["curve"] if math.isfinite(c["loss"])]
    lrs, losses, smoothed = ([c[key] for c in curve] for key in ("lr", "loss", "smoothed"))
    title = f"lr range test: {result['steps_run']} steps, {result['stopped']}"
    with figure(path, title, (1, 1), (7.5, 4.5)) as (ax,):
        ax.plot(lrs, losses, color="#9ecae1", lw=1, label="loss (one step)")
        ax.plot(lrs, smoothed, color="#1f77b4", lw=2, label="smoothed")
        styles = {"minimum": "#d62728", "steep": "#2ca02c", "valley": "#9467bd"}
        for name, lr in result["picks"].items():
            picked = name == result["rule"]
            ax.axvline(lr, color=styles[name], ls="--" if picked else ":", lw=2 if picked else 1,
                       label=f"{name} {lr:.3g}" + (" (the pick)" if picked else ""))
        ax.axvline(result["lr_min_loss"], color="#7f7f7f", ls=":",
                   label=f"smoothed minimum {result['lr_min_loss']:.3g}")
        low, high = min(min(smoothed), min(losses)), smoothed[0]  # the divergence stays off-scale
        ax.set_ylim(low - 0.1 * (high - low + 1e-9), max(high, low) + 0.3 * (high - low + 1e-9))
        ax.set(xscale="log", xlabel="learning rate", ylabel="train loss")
        ax.legend(fontsize=8)


def plot_coord_check(result: dict[str, Any], path: Path) -> None:
    """coord_check.png: muP's coordinate check, one panel per parametrization and layer group: the mean
    |activation| against the width (both log scales), one line per step. Flat lines: the parametrization keeps
    coordinates the same size at every width."""
    runs, groups, steps = result["runs"], result["groups"], result["steps"]
    widths = [f"{w:g}" for w in result["widths"]]
    hidden = [result["hidden_sizes"][w] for w in widths]
    colours = pyplot().get_cmap("viridis")
    title = (f"coordinate check: {result['optimizer']}, lr {result['lr']:g}, {steps} steps "
             "(x: widest / narrowest at the last step)")
    with figure(path, title, (len(runs), len(groups)), (3.2, 2.8)) as axes:
        for ax, ((name, run), group) in zip(axes, itertools.product(runs.items(), groups), strict=True):
            for step in range(steps):
                ax.plot(hidden, [run["curves"][w][step][group] for w in widths], marker="o", ms=3,
                        color=colours(step / max(1, steps - 1)), label=f"step {step}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{name}: {group} (x{run['growth'][group]:.2g})", fontsize=9)
        for ax in axes[-len(groups):]:
            ax.set_xlabel("hidden size")
        for ax in axes[::len(groups)]:
            ax.set_ylabel("mean |activation|")
        axes[len(groups) - 1].legend(fontsize=7)
