"""coord_check.png: muP's coordinate check, one panel per parametrization and layer group: the mean |activation|
against the width (both log scales), one line per step. Flat lines: the parametrization keeps coordinates the
same size at every width."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmexp.report.plots import _pyplot, _save


def plot_coord_check(result: dict[str, Any], path: Path) -> None:
    """Rows: the parametrizations checked; columns: the layer groups; x: hidden size; a line per step."""
    plt = _pyplot()
    runs, groups = result["runs"], result["groups"]
    widths = [f"{w:g}" for w in result["widths"]]
    hidden = [result["hidden_sizes"][w] for w in widths]
    fig, axes = plt.subplots(len(runs), len(groups), figsize=(3.2 * len(groups), 2.8 * len(runs)), squeeze=False)
    colors = plt.get_cmap("viridis")
    for row, (name, run) in enumerate(runs.items()):
        for col, group in enumerate(groups):
            ax = axes[row][col]
            for step in range(result["steps"]):
                sizes = [run["curves"][w][step][group] for w in widths]
                ax.plot(hidden, sizes, marker="o", ms=3, color=colors(step / max(1, result["steps"] - 1)),
                        label=f"step {step}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{name}: {group} (x{run['growth'][group]:.2g})", fontsize=9)
            ax.grid(alpha=0.25, which="both")
            if row == len(runs) - 1:
                ax.set_xlabel("hidden size")
            if col == 0:
                ax.set_ylabel("mean |activation|")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"coordinate check: {result['optimizer']}, lr {result['lr']:g}, {result['steps']} steps "
                 "(x: widest / narrowest at the last step)", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
