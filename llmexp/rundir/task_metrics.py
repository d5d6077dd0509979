"""A run's task metrics (`eval_task` records of metrics.jsonl) and any metric by its `sweep.metric` name, as pure
functions of records, so summary.json, the reports and a search's pruner read alike."""

from __future__ import annotations

import math
from typing import Any

TASK_EVENT = "eval_task"


def task_records(records: list[dict]) -> list[dict]:
    """The eval_task records that carry a metrics dict, in order."""
    return [r for r in records if r.get("event") == TASK_EVENT and isinstance(r.get("metrics"), dict)]


def task_history(records: list[dict]) -> dict[str, list[tuple[int, dict[str, float]]]]:
    """{task: [(step, {metric: value}), ...]} in step order; a step logged twice (a resume) keeps the last."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for r in task_records(records):
        out.setdefault(str(r["task"]), {})[int(r["step"])] = r["metrics"]
    return {task: sorted(steps.items()) for task, steps in out.items()}


def final_tasks(records: list[dict]) -> dict[str, dict[str, Any]]:
    """summary.json's `tasks`: each task's metrics at its last eval, with that step and its kind."""
    return {str(r["task"]): {**r["metrics"], "step": r["step"], "kind": r.get("kind")} for r in task_records(records)}


def metric_value(metric: str, summary: dict | None, records: list[dict]) -> float | None:
    """The final value of a `sweep.metric` name: summary.json's, else the newest record's; None when the run
    never recorded it (or it is not a finite number)."""
    summary = summary or {}
    if metric in ("eval_loss", "eval_ppl"):
        value = summary.get(metric)
        if value is None:
            value = next((r[metric] for r in reversed(records) if r.get("event") == "eval" and metric in r), None)
    else:
        task, _, name = metric.partition("/")[2].partition("/")
        tasks = summary.get("tasks") if isinstance(summary.get("tasks"), dict) else final_tasks(records)
        value = (tasks.get(task) or {}).get(name)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def metric_at(metric: str, eval_record: dict, step_tasks: list[dict]) -> float | None:
    """The value of `metric` at one eval: its `eval` record and the eval_task records of the same step."""
    if metric in ("eval_loss", "eval_ppl"):
        value = eval_record.get(metric)
    else:
        task, _, name = metric.partition("/")[2].partition("/")
        value = next((r["metrics"].get(name) for r in step_tasks if r.get("task") == task), None)
    return float(value) if isinstance(value, int | float) else None
