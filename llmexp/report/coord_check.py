"""coord_check.png: muP's coordinate check, one panel per parametrization and layer group: the mean |activation|
against the width (both log scales), one line per step. Flat lines: the parametrization keeps coordinates the
same size at every width."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from llmexp.report.plots import _pyplot, figure


def plot_coord_check(result: dict[str, Any], path: Path) -> None:
    runs, groups, steps = result["runs"], result["groups"], result["steps"]
    widths = [f"{w:g}" for w in result["widths"]]
    hidden = [result["hidden_sizes"][w] for w in widths]
    colours = _pyplot().get_cmap("viridis")
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
