"""lr_find.png: an lr range test's loss against the lr (log scale), with each rule's pick and the minimum marked."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from llmexp.report.plots import _pyplot, _save


def plot_lr_find(result: dict[str, Any], path: Path) -> None:
    """The raw and smoothed losses of `lr_find.json`'s curve; vertical lines at each rule's pick and the minimum."""
    plt = _pyplot()
    curve = [c for c in result["curve"] if math.isfinite(c["loss"])]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    lrs = [c["lr"] for c in curve]
    ax.plot(lrs, [c["loss"] for c in curve], color="#9ecae1", lw=1, label="loss (one step)")
    ax.plot(lrs, [c["smoothed"] for c in curve], color="#1f77b4", lw=2, label="smoothed")
    styles = {"minimum": "#d62728", "steep": "#2ca02c", "valley": "#9467bd"}
    for name, lr in result["picks"].items():
        picked = name == result["rule"]
        ax.axvline(lr, color=styles[name], ls="--" if picked else ":", lw=2 if picked else 1,
                   label=f"{name} {lr:.3g}" + (" (the pick)" if picked else ""))
    ax.axvline(result["lr_min_loss"], color="#7f7f7f", ls=":", label=f"smoothed minimum {result['lr_min_loss']:.3g}")
    smoothed = [c["smoothed"] for c in curve]
    low, high = min(min(smoothed), min(c["loss"] for c in curve)), smoothed[0]  # the divergence stays off-scale
    ax.set_ylim(low - 0.1 * (high - low + 1e-9), max(high, low) + 0.3 * (high - low + 1e-9))
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("train loss")
    ax.set_title(f"lr range test: {result['steps_run']} steps, {result['stopped']}", fontsize=10)
    ax.grid(alpha=0.25, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
