"""Pictures for the reports: a run's curves with its findings marked, and a sweep's overlaid curves.

matplotlib (Agg backend) is imported inside the functions, so importing this module costs nothing.
Files are written to a temporary name and renamed, so a reader never sees half a PNG.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from llmexp.rundir.files import atomic_file

SEVERITY_COLOURS = {"error": "#d62728", "warning": "#ff7f0e", "info": "#7f7f7f"}
GRAD_BAND = (0.5, 2.0)  # the seed's healthy grad-norm band


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _shown(title: str) -> str:
    """A title from a directory's name, whose bytes may not be UTF-8: escaped, as Python prints them."""
    return title.encode("utf-8", "backslashreplace").decode()


def _save(fig: Any, path: Path, tight: bool = True) -> None:
    try:
        with atomic_file(Path(path), "wb") as f:
            fig.savefig(f, format="png", dpi=110, bbox_inches="tight" if tight else None)
    finally:
        _pyplot().close(fig)


def _xy(records: list[dict], event: str, key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        if r.get("event") == event and key in r:
            value = r[key]
            xs.append(int(r["step"]))
            ys.append(float(value) if isinstance(value, int | float) else math.nan)
    return xs, ys


def _finite_xy(xs: list[int], ys: list[float]) -> tuple[list[int], list[float]]:
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if math.isfinite(y)]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _marker(xs: list[int]) -> str | None:
    """Dots on short series, where a line alone may be a single invisible point."""
    return "." if len(xs) < 30 else None


def _loss_panel(ax: Any, records: list[dict]) -> None:
    xs, ys = _xy(records, "train", "loss")
    fx, fy = _finite_xy(xs, ys)
    ax.plot(fx, fy, lw=1.2, color="#1f77b4", label="train loss", marker=_marker(fx))
    ex, ey = _finite_xy(*_xy(records, "eval", "eval_loss"))
    ax.plot(ex, ey, "o-", ms=4, lw=1.5, color="#2ca02c", label="eval loss")
    bad = [x for x, y in zip(xs, ys, strict=True) if not math.isfinite(y)]
    anomalies = [r for r in records if r.get("event") == "anomaly"]
    bad += [int(r["step"]) for r in anomalies]
    if bad:  # drawn along the bottom edge: a NaN has no height, and a blow-up would squash the curve
        ax.plot(bad, [0.03] * len(bad), "x", color=SEVERITY_COLOURS["error"], ms=8, mew=2,
                transform=ax.get_xaxis_transform(), label="non-finite / anomaly")
    for r in anomalies[:5]:
        value = r.get("loss")
        text = f"loss {value:.3g}" if isinstance(value, int | float) else "loss NaN"
        ax.annotate(f"{text} ({r.get('action', '?')})", xy=(int(r["step"]), 0.03), xycoords=ax.get_xaxis_transform(),
                    xytext=(6, 4), textcoords="offset points", fontsize=7, color=SEVERITY_COLOURS["error"])
    finite = fy + ey
    if finite:  # a single huge value must not flatten the rest of the curve
        lo, hi = min(finite), sorted(finite)[max(0, int(0.98 * len(finite)) - 1)]
        pad = 0.05 * (hi - lo or 1.0)
        ax.set_ylim(lo - pad, max(hi, ey[0] if ey else hi) + pad)
    ax.set_title("loss")
    ax.legend(loc="center right", fontsize=8)


def _grad_panel(ax: Any, records: list[dict], max_grad_norm: float | None) -> None:
    fx, fy = _finite_xy(*_xy(records, "train", "grad_norm"))
    ax.axhspan(*GRAD_BAND, color="#2ca02c", alpha=0.08, label="seed's band 0.5-2.0")
    ax.plot(fx, fy, lw=1.2, color="#9467bd", label="grad norm (pre-clip)", marker=_marker(fx))
    if max_grad_norm:
        ax.axhline(max_grad_norm, ls="--", lw=1, color="#555555", label=f"clip at {max_grad_norm:g}")
    if fy and min(fy) > 0:
        ax.set_yscale("log")
    ax.set_title("grad norm")
    ax.legend(loc="upper right", fontsize=8)


def _simple_panel(ax: Any, records: list[dict], key: str, title: str, colour: str) -> None:
    fx, fy = _finite_xy(*_xy(records, "train", key))
    if fx:
        ax.plot(fx, fy, lw=1.2, color=colour, marker=_marker(fx))
    else:
        ax.text(0.5, 0.5, f"no {key} logged", ha="center", va="center", transform=ax.transAxes, color="#888888")
    ax.set_title(title)


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
    lines = []
    for i, f in enumerate(findings[:12], start=1):
        message = f["message"] if len(f["message"]) <= 110 else f["message"][:107] + "..."
        state = f" ({f['status']} at step {f.get('resolved_at')})" if f.get("status", "open") != "open" else ""
        lines.append(f"{i}. [{f['severity']}] {f['kind']} @ step {f['step']}{state}: {message}")
    if len(findings) > 12:
        lines.append(f"... and {len(findings) - 12} more (see report.md)")
    return lines


def plot_run(records: list[dict], findings: list[dict], path: Path, title: str = "",
             max_grad_norm: float | None = None) -> None:
    """curves.png: loss (train and eval), lr, grad norm and throughput, with findings marked; and a panel of
    the task metrics when the run scored tasks (`eval`)."""
    from llmexp.report.task_section import tasks_panel
    from llmexp.rundir.task_metrics import task_records

    plt = _pyplot()
    with_tasks = bool(task_records(records))
    caption = _findings_caption(findings)
    caption_in, panels_in = 0.3 + 0.14 * len(caption), 10.5 if with_tasks else 7.5
    height_in = panels_in + caption_in
    fig, grid = plt.subplots(3 if with_tasks else 2, 2, figsize=(12, height_in), sharex=True)
    # Fixed margins, the caption's room reserved below the panels: tight_layout and a tight bounding box would
    # lay the figure out three times, ~1 s of CPU at the end of every run (measured on a 2-core AMD Zen 3).
    fig.subplots_adjust(left=0.07, right=0.98, top=1 - 0.55 / height_in, bottom=(caption_in + 0.45) / height_in,
                        hspace=0.3, wspace=0.2)
    axes = [grid[0][0], grid[0][1], grid[1][0], grid[1][1]]
    if with_tasks:
        tasks_panel(grid[2][0], records)
        grid[2][1].axis("off")
        axes.append(grid[2][0])
    _loss_panel(axes[0], records)
    _grad_panel(axes[1], records, max_grad_norm)
    _simple_panel(axes[2], records, "lr", "learning rate", "#8c564b")
    _simple_panel(axes[3], records, "tokens_per_sec", "tokens/s", "#e377c2")
    axes[2].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    _mark_events(axes, records, findings)
    fig.text(0.01, (caption_in - 0.1) / height_in, "\n".join(caption), fontsize=8, va="top",
             family="monospace" if findings else None, color=None if findings else "#2ca02c")
    for ax in axes[2:] if not with_tasks else axes[3:]:  # the bottom of each column
        ax.set_xlabel("step")
        ax.xaxis.set_tick_params(labelbottom=True)
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.grid(alpha=0.25)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    worst = next((s for s in ("error", "warning", "info") if any(f["severity"] == s for f in findings)), None)
    fig.suptitle(f"{_shown(title)}  ·  {len(findings)} finding(s)" + (f", worst: {worst}" if worst else ""),
                 fontsize=11)
    _save(fig, path, tight=False)


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
    plt = _pyplot()
    distinct = _ordered(set(values))
    nums = [_as_float(v) for v in distinct]
    if len(distinct) > 1 and all(n is not None for n in nums):
        lo, hi = min(nums), max(nums)  # type: ignore[type-var]
        use_log = lo > 0 and hi / lo >= 10  # type: ignore[operator]
        pos = [(math.log(n) - math.log(lo)) / (math.log(hi) - math.log(lo)) if use_log  # type: ignore[arg-type]
               else (n - lo) / (hi - lo) for n in nums]  # type: ignore[operator]
        cmap = plt.get_cmap("plasma")
        return {v: cmap(0.05 + 0.8 * p) for v, p in zip(distinct, pos, strict=True)}
    cmap = plt.get_cmap("tab10")
    return {v: cmap(i % 10) for i, v in enumerate(distinct)}


def _heatmap(ax: Any, jobs: list[dict], keys: list[str]) -> None:
    """Final eval loss over the first two swept parameters (best over any others)."""
    rows = _ordered({j["params"].get(keys[0], "") for j in jobs})
    cols = _ordered({j["params"].get(keys[1], "") for j in jobs})
    grid = [[math.nan] * len(cols) for _ in rows]
    failed = set()
    for j in jobs:
        r, c = rows.index(j["params"].get(keys[0], "")), cols.index(j["params"].get(keys[1], ""))
        loss = _as_float(j.get("eval_loss"))
        if loss is not None and math.isfinite(loss) and j["status"] in ("completed", "early_stopped"):
            grid[r][c] = loss if math.isnan(grid[r][c]) else min(grid[r][c], loss)
        else:
            failed.add((r, c))
    image = ax.imshow(grid, cmap="viridis_r", aspect="auto")
    for r in range(len(rows)):
        for c in range(len(cols)):
            text = f"{grid[r][c]:.3g}" if math.isfinite(grid[r][c]) else ("failed" if (r, c) in failed else "–")
            colour = "#d62728"
            if math.isfinite(grid[r][c]):  # dark text on the light end of the colour map
                red, green, blue, _ = image.cmap(image.norm(grid[r][c]))
                colour = "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.5 else "white"
            ax.text(c, r, text, ha="center", va="center", fontsize=9, color=colour)
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel(keys[1])
    ax.set_ylabel(keys[0])
    ax.set_title("final eval loss")
    ax.figure.colorbar(image, ax=ax, shrink=0.8)


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def plot_sweep(jobs: list[dict], curves: dict[str, list[dict]], varying: list[str], path: Path,
               title: str = "", recommended: str | None = None) -> None:
    """sweep_curves.png: train and eval loss of every job, coloured by the first swept parameter,
    marked by the second; a heatmap of the final eval loss when two or more parameters vary.
    Unfinished jobs are dashed; the recommended job (by job name) is drawn thick."""
    plt = _pyplot()
    ncols = 3 if len(varying) >= 2 else 2
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.8))
    key = varying[0] if varying else None
    colours = _colour_map([j["params"].get(key, "") if key else j["job"] for j in jobs])
    second = sorted({j["params"].get(varying[1], "") for j in jobs}, key=lambda v: (_as_float(v) or 0.0, v)) \
        if len(varying) >= 2 else [""]
    for j in jobs:
        label = " ".join(f"{k}={j['params'].get(k)}" for k in varying) or f"job {j['job']}"
        finished = j["status"] in ("completed", "early_stopped")
        style = {"color": colours[j["params"].get(key, "") if key else j["job"]], "ls": "-" if finished else "--",
                 "lw": 2.6 if j["job"] == recommended else 1.2, "ms": 4,
                 "marker": _MARKERS[second.index(j["params"].get(varying[1], "")) % len(_MARKERS)]
                 if len(varying) >= 2 else "o"}
        label += " (recommended)" if j["job"] == recommended else ("" if finished else f" [{j['status']}]")
        records = curves.get(j["job"], [])
        axes[0].plot(*_finite_xy(*_xy(records, "train", "loss")), label=label, markevery=0.2, **style)
        axes[1].plot(*_finite_xy(*_xy(records, "eval", "eval_loss")), label=label, **style)
    for ax, name in zip(axes[:2], ("train loss", "eval loss"), strict=True):
        ax.set_title(name + (f" (colour: {key}" + (f", marker: {varying[1]})" if len(varying) >= 2 else ")")
                             if key else ""))
        ax.set_xlabel("step")
        ax.grid(alpha=0.25)
        _clip_ylim(ax)
    axes[1].legend(fontsize=7, loc="upper right")
    if len(varying) >= 2:
        _heatmap(axes[2], jobs, varying)
    fig.suptitle(_shown(title), fontsize=11)
    fig.tight_layout()
    _save(fig, path)


def _clip_ylim(ax: Any) -> None:
    """Keep a diverged job's huge losses from flattening everyone else's curves."""
    ys = sorted(y for line in ax.get_lines() for y in line.get_ydata() if math.isfinite(y))
    if len(ys) >= 4:
        lo, hi = ys[0], ys[int(0.95 * (len(ys) - 1))]
        ax.set_ylim(lo - 0.05 * (hi - lo or 1.0), hi + 0.15 * (hi - lo or 1.0))


# ----- searches (sweep=random|tpe) ----------------------------------------------------------------

_STATE_STYLE = {"complete": ("o", "#1f77b4"), "pruned": ("X", "#ff7f0e"), "running": ("o", "#7f7f7f"),
                "fail": ("x", SEVERITY_COLOURS["error"])}


def _history_panel(ax: Any, rows: list[dict]) -> None:
    """Each trial's value (a pruned or running trial's latest eval loss, hollow) and the best so far."""
    for state, (marker, colour) in _STATE_STYLE.items():
        picked = [r for r in rows if r["state"] == state]
        if state == "fail":  # no loss to place: marked along the bottom edge
            if picked:
                ax.plot([r["number"] for r in picked], [0.03] * len(picked), marker, color=colour, ms=8, mew=2,
                        transform=ax.get_xaxis_transform(), label="failed")
            continue
        key = "value" if state == "complete" else "last_eval_loss"
        pts = [(r["number"], r[key]) for r in picked if isinstance(r[key], int | float) and math.isfinite(r[key])]
        if pts:
            label = {"complete": "complete (final eval loss)", "pruned": "pruned (eval loss when stopped)",
                     "running": "running (latest eval loss)"}[state]
            ax.plot(*zip(*pts, strict=True), marker, ls="none", color=colour, ms=7, label=label,
                    mfc=colour if state == "complete" else "none", mew=1.5)
    best = [(r["number"], r["best_so_far"]) for r in rows if r["best_so_far"] is not None]
    if best:
        ax.step(*zip(*best, strict=True), where="post", color="#2ca02c", lw=2, label="best so far")
    ax.set_xlabel("trial")
    ax.set_title("optimisation history")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8, loc="best")


def _trial_curves_panel(ax: Any, rows: list[dict]) -> None:
    """Every trial's eval loss by step; a pruned trial's curve ends in a marker at the step it stopped."""
    for r in rows:
        if not r["curve"]:
            continue
        xs, ys = _finite_xy([s for s, _ in r["curve"]], [v for _, v in r["curve"]])
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
    ax.set_xlabel("step")
    ax.set_title("eval loss of each trial")
    ax.legend(fontsize=8, loc="upper right")
    _clip_ylim(ax)


def _landscape_panel(ax: Any, rows: list[dict], name: str, log: bool) -> None:
    """Final eval loss against the first searched parameter (pruned trials at their last eval loss)."""
    for state in ("complete", "pruned", "running"):
        marker, colour = _STATE_STYLE[state]
        key = "value" if state == "complete" else "last_eval_loss"
        pts = [(float(r["params"][name]), r[key]) for r in rows if r["state"] == state
               and isinstance(r["params"].get(name), int | float) and isinstance(r[key], int | float)]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker, ls="none", color=colour, ms=7, mew=1.5,
                    mfc=colour if state == "complete" else "none")
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(name)
    ax.set_title(f"eval loss by {name}")


def plot_search(search: dict[str, Any], path: Path, title: str = "") -> None:
    """sweep_search.png: the optimisation history (value per trial, best-so-far line), every trial's eval
    curve with pruned ones ending in a marker at their stop step, and the loss against the first numeric
    parameter searched."""
    plt = _pyplot()
    rows = search["trials"]
    numeric = [k for k, v in search["space"].items() if not v.startswith("one of")]
    fig, axes = plt.subplots(1, 3 if numeric else 2, figsize=(18 if numeric else 12, 4.8))
    _history_panel(axes[0], rows)
    _trial_curves_panel(axes[1], rows)
    if numeric:
        _landscape_panel(axes[2], rows, numeric[0], search["space"][numeric[0]].startswith("log"))
    for ax in axes:
        ax.grid(alpha=0.25)
        ax.set_ylabel("eval loss")
    counts = search["counts"]
    fig.suptitle(f"{_shown(title)}  ·  {search['sampler']} + {search['pruner']}: {counts['complete']} complete, "
                 f"{counts['pruned']} pruned, {counts['fail']} failed, {counts['running']} running", fontsize=11)
    fig.tight_layout()
    _save(fig, path)
