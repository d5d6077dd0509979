"""fit.png for `python -m llmexp.fit`, drawn in `plots.figure`: what docs/tutorials/tune-small-train-big.md (section 4)
says it draws, and the best batch as the best lr where batch_size was swept."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from llmexp.report.formats import fmt_params
from llmexp.report.plots import figure, pyplot

CAPTION = ("DeepSeek LLM (2024) fitted eta_opt = 0.3118 C^-0.125 and B_opt = 0.2920 C^0.3271 (tokens) against compute "
           "C in FLOPs; drawn here at C ~ 6 N D, N the parameters, D the tokens the jobs saw ({tokens}), so it is "
           "a rough guide (DeepSeek's C counts non-embedding FLOPs per token). Intervals: 95%; per size a parametric "
           "bootstrap of the parabola, on b the law's least squares (3+ sizes) or the vertices' bootstrap (2 sizes).")


def _loss_panel(ax: Any, sizes: list[dict], colours: list[Any]) -> None:
    for s, colour in zip(sizes, colours, strict=True):
        lrs, losses = [p["lr"] for p in s["points"]], [p["loss"] for p in s["points"]]
        ax.plot(lrs, losses, "o", color=colour, ms=5, label=f"{fmt_params(s['params'])} params")
        if s["coef"] is not None and s["best_lr"] is not None:  # the parabola is in ln(lr)
            xs = np.linspace(math.log(s["fitted"][0]), math.log(s["fitted"][-1]), 60)
            ax.plot(np.exp(xs), np.polyval(s["coef"], xs), "-", color=colour, lw=1.2)
            ax.plot([s["best_lr"]], [float(np.polyval(s["coef"], math.log(s["best_lr"])))], "*", color=colour,
                    ms=12, mec="black")
            if s["interval"]:
                ax.axvspan(*s["interval"], color=colour, alpha=0.12)
        elif s["edge"]:
            ax.annotate(f"edge: extend {'down' if s['edge'] == 'low' else 'up'}", (s["grid_best_lr"], min(losses)),
                        xytext=(-60, 6), textcoords="offset points", fontsize=7, color=colour)
    ax.set(xscale="log", xlabel="lr", ylabel="final eval loss")
    ax.set_title("loss vs lr per size (parabola in log lr, * vertex)", fontsize=10)
    ax.legend(fontsize=7)


def _against_size(ax: Any, result: dict, ns: np.ndarray, law: str, ylabel: str, title: str) -> None:
    """DeepSeek LLM's `law` at C ~ 6 N D (D: the jobs' median tokens seen), on log-log axes against the size."""
    tokens = float(np.median([s["tokens_seen"] for s in result["sizes"]]))
    ds = result["deepseek_llm"][law]
    ax.plot(ns, ds["a"] * (6 * ns * tokens) ** ds["b"], ":", color="#2ca02c", label="DeepSeek LLM at C~6ND")
    ax.set(xscale="log", yscale="log", xlabel="parameters N", ylabel=ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def _lr_panel(ax: Any, result: dict, ns: np.ndarray, seed_lr: Callable[[float], float] | None) -> None:
    sizes, law, target = result["sizes"], result["lr_law"], result["target"]
    with_best = [s for s in sizes if s["best_lr"] is not None]
    # (a noisy size's bootstrap interval may lie to one side of its vertex: the bar then stops at the vertex)
    lo = [max(0.0, s["best_lr"] - s["interval"][0]) if s["interval"] else 0.0 for s in with_best]
    hi = [max(0.0, s["interval"][1] - s["best_lr"]) if s["interval"] else 0.0 for s in with_best]
    ax.errorbar([s["params"] for s in with_best], [s["best_lr"] for s in with_best], yerr=[lo, hi], fmt="o",
                color="#1f77b4", capsize=3, label="best lr (vertex)", zorder=3)
    edges = [s for s in sizes if s["best_lr"] is None]
    if edges:
        ax.plot([s["params"] for s in edges], [s["grid_best_lr"] for s in edges], "x", color="#d62728",
                label="grid's best (at its edge)")
    if law["fitted"]:
        ax.plot(ns, law["a"] * ns ** law["b"], "-", color="#1f77b4", label=f"fit: {law['a']:.3g} N^{law['b']:.3f}")
    if seed_lr is not None:
        ax.step(ns, [seed_lr(n) for n in ns], where="post", color="#7f7f7f", ls="--", label="seed's table (lr=auto)")
    if target and target["lr"]:
        ax.errorbar([target["params"]], [target["lr"]], fmt="D", color="#9467bd", label="target",
                    yerr=None if not target["interval"] else
                    [[target["lr"] - target["interval"][0]], [target["interval"][1] - target["lr"]]], capsize=3)
    _against_size(ax, result, ns, "lr", "best lr", "best lr vs size" + (" (muP)" if result["mup"] else ""))


def _batch_panel(ax: Any, result: dict, ns: np.ndarray) -> None:
    sizes, law = result["sizes"], result["batch_law"]
    swept = [s for s in sizes if s["batch"] and s["batch"]["best_batch_tokens"] is not None]
    ax.plot([s["params"] for s in swept], [s["batch"]["best_batch_tokens"] for s in swept], "o", color="#ff7f0e",
            label="best batch (vertex)")
    context = float(np.median([s["batch"]["context"] for s in sizes if s["batch"]]))
    if law["fitted"]:
        ax.plot(ns, law["a"] * ns ** law["b"] * context, "-", color="#ff7f0e", label=f"fit: N^{law['b']:.3f}")
    _against_size(ax, result, ns, "batch_tokens", "best batch (tokens per step)", "best batch vs size")


def plot_fit(result: dict, path: Path, seed_lr: Callable[[float], float] | None) -> None:
    sizes = result["sizes"]
    with_batch = any(s["batch"] for s in sizes)
    tokens = ", ".join(f"{fmt_params(s['tokens_seen'])} at {fmt_params(s['params'])}" for s in sizes)
    caption = textwrap.wrap(CAPTION.format(tokens=tokens), 150 if with_batch else 120)
    colours = [pyplot().get_cmap("viridis")(i / max(1, len(sizes) - 1) * 0.9) for i in range(len(sizes))]
    title = "lr fit: " + ", ".join(Path(d).name for d in result["sweep_dirs"])
    counts = [s["params"] for s in sizes] + ([result["target"]["params"]] if result["target"] else [])
    ns = np.geomspace(min(counts) / 2, max(counts) * 2, 80)  # the sizes against which the laws are drawn
    with figure(path, title, (1, 3 if with_batch else 2), (5.2, 4.6), caption) as axes:
        _loss_panel(axes[0], sizes, colours)
        _lr_panel(axes[1], result, ns, seed_lr)
        if with_batch:
            _batch_panel(axes[2], result, ns)
