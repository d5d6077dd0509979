"""What every sink is and takes from a record: its numbers under `train/`, `eval/` or `tasks/<name>/`, and a
run's name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from llmexp.rundir.redact import scrub_overrides


class Sink(Protocol):
    """Where the records go besides metrics.jsonl and the console (wandb, TensorBoard, MLflow)."""

    def log(self, record: dict[str, Any]) -> None: ...

    def reset(self, records: list[dict[str, Any]]) -> None:
        """The run (re)starts from these records: a checkpoint's history on resume, none otherwise. Nothing to do
        where a step logged twice shows its latest value (wandb plots against trainer/step, TensorBoard by step)."""

    def close(self) -> None: ...


def cut(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters ending in `...` when it is longer (a tool's limit on a value)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def run_name_from_overrides(overrides: list[str] | str, max_len: int = 128) -> str:
    """A readable run name from the overrides (`lr=1e-3,batch_size=4`), secrets removed; `default` if none."""
    items = overrides.split(",") if isinstance(overrides, str) else list(overrides)
    items = [o for o in scrub_overrides([o for o in items if o]) if not o.lstrip("+~").startswith("hydra.")]
    return cut(",".join(items) or "default", max_len)


def numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric fields of a train or eval record, under `train/` or `eval/`, and a task's metrics under
    `tasks/<name>/`; NaN/inf kept as floats."""
    event = record.get("event")
    if event == "eval_task":  # tasks/<name>/<metric>: the names sweep.metric takes
        prefix, values = f"tasks/{record['task']}/", record["metrics"]
    elif event in ("train", "eval"):
        prefix, values = f"{event}/", {k: v for k, v in record.items() if k not in ("event", "step")}
    else:
        return {}
    return {prefix + k: float(v) for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
