"""The run report's task section: a table per task over the eval steps, and the curves' task panel."""

from __future__ import annotations

from typing import Any

from llmexp.report.formats import fmt, md_cell, md_table
from llmexp.rundir.task_metrics import task_history, task_records

SHOWN_STEPS = 12
"""Columns of a task's table at most: the first, the last and evenly spaced steps between."""


def _steps_shown(steps: list[int]) -> list[int]:
    if len(steps) <= SHOWN_STEPS:
        return steps
    picks = {round(i * (len(steps) - 1) / (SHOWN_STEPS - 1)) for i in range(SHOWN_STEPS)}
    return [steps[i] for i in sorted(picks)]


def tasks_markdown(records: list[dict]) -> str:
    """## Tasks: for each task, one row per metric and one column per eval step (and a generation task's
    examples at its last eval); empty when the run scored no task."""
    history = task_history(records)
    if not history:
        return ""
    kinds = {r["task"]: r.get("kind", "") for r in task_records(records)}
    parts = ["## Tasks\n"]
    for task, points in history.items():
        by_step = dict(points)
        steps = _steps_shown(list(by_step))
        metrics = list(points[-1][1])
        parts.append(f"**{task}** ({kinds.get(task, '')}), by eval step: `tasks/{task}/<metric>`\n")
        rows = md_table(["metric", *(f"step {s}" for s in steps)],
                        ([m, *(fmt(by_step[s].get(m), 4) for s in steps)] for m in metrics))
        parts.append("\n".join(rows) + "\n")
        parts.append(_examples(records, task))
    return "\n".join(p for p in parts if p)


def _examples(records: list[dict], task: str) -> str:
    last = next((r for r in reversed(task_records(records)) if r["task"] == task and r.get("examples")), None)
    if last is None:
        return ""
    rows = md_table(["prompt", "completion", "target"],
                    ([md_cell(e["prompt"]), md_cell(e["completion"]), md_cell(e["target"])] for e in last["examples"]))
    return "\n".join([f"Examples at step {last['step']}:\n", *rows]) + "\n"


def tasks_panel(ax: Any, records: list[dict]) -> None:
    """Every task metric against the step: scores in [0, 1] on the left axis, losses on a right one."""
    history = task_history(records)
    twin = None
    for task, points in history.items():
        steps = [s for s, _ in points]
        for metric in points[-1][1]:
            ys = [m.get(metric) for _, m in points]
            loss_like = metric in ("loss", "ppl")
            if metric == "ppl":
                continue  # the loss says the same, on a readable scale
            target = ax
            if loss_like:
                twin = twin or ax.twinx()
                target = twin
            target.plot(steps, ys, marker="o", ms=3, ls="--" if loss_like else "-", label=f"{task}/{metric}")
    ax.set_title("tasks (scores; dashed: loss, right axis)", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    if twin is not None:
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if handles:
        ax.legend(handles, labels, fontsize=7, loc="best")
