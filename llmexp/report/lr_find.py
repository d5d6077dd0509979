"""lr_find.png: an lr range test's raw and smoothed loss against the lr (log scale), each rule's pick, the minimum."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from llmexp.report.plots import figure


def plot_lr_find(result: dict[str, Any], path: Path) -> None:
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
