"""The run report (report.md, curves.png): a pure function of what a run directory holds (read through
`llmexp.rundir.read`), so it works after the fact (`python -m llmexp.report RUN_DIR`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from llmexp.monitor.detectors import ERROR, is_open, worst_severity
from llmexp.report.findings import finding_state, run_findings
from llmexp.report.formats import fmt, fmt_rate, is_finite, md_cell, md_table
from llmexp.rundir import read
from llmexp.rundir.files import write_text_atomic
from llmexp.rundir.task_metrics import task_history, task_records


def _key_metrics(records: list[dict], summary: dict) -> list[tuple[str, str]]:
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("event") == "eval" and is_finite(r.get("eval_loss"))]
    best = min(evals, key=lambda sv: sv[1]) if evals else None
    pick = lambda key, event="train": summary.get(key, read.last_value(records, event, key))  # noqa: E731
    rows = [
        ("steps", fmt(pick("step"))),
        ("final train loss", fmt(summary.get("train_loss", read.last_value(records, "train", "loss")))),
        ("final eval loss", fmt(pick("eval_loss", "eval"))),
        ("final eval ppl", fmt(pick("eval_ppl", "eval"))),
        ("best eval loss", f"{best[1]:.4g} (step {best[0]})" if best else "–"),
        ("tokens/s", fmt_rate(pick("tokens_per_sec"))),
        ("MFU", "not reported (see the mfu_unavailable finding)" if "mfu" in summary and summary["mfu"] is None
         else fmt(pick("mfu"), 3)),
        ("peak memory (MB)", fmt(summary.get("peak_mem_mb", read.last_value(records, "train", "mem_mb")))),
        ("wall time (s)", fmt(pick("time_s"))),
        ("parameters", _parameters(summary)),
        ("lr", fmt(summary.get("lr")) + (f" ({summary['lr_source']})" if summary.get("lr_source") else "")),
    ]
    return [(k, v) for k, v in rows if v != "–"]


def _parameters(summary: dict[str, Any]) -> str:
    """The trained parameters; with adapters, also of how many (frozen base included)."""
    trained, total = summary.get("num_params"), summary.get("total_params")
    if isinstance(trained, int) and isinstance(total, int) and total > trained:
        return f"{fmt(trained)} trained of {fmt(total)} ({trained / total:.2%}: adapters)"
    return fmt(trained)


_SETTINGS = (
    ("model", "model.name"), ("model path", "model.name_or_path"), ("hidden size", "model.hidden_size"),
    ("width multiplier (x hidden size, intermediate size, heads)", "model.width_mult"),
    ("parametrization", "model.parametrization"), ("layers", "model.num_hidden_layers"), ("lr", "lr"),
    ("batch size (per device)", "batch_size"), ("gradient accumulation", "train.gradient_accumulation_steps"),
    ("global batch size", "train.global_batch_size"), ("max steps", "train.max_steps"),
    ("precision", "precision.name"), ("optimizer", "optimizer.name"), ("weight decay", "train.weight_decay"),
    ("scheduler", "scheduler.name"), ("warmup ratio", "train.warmup_ratio"), ("warmup steps", "train.warmup_steps"),
    ("max grad norm (clipping)", "train.max_grad_norm"), ("on anomaly", "train.on_anomaly"),
    ("early stopping patience", "train.early_stopping_patience"), ("data", "data.name"),
    ("max length", "data.max_length"), ("deepspeed", "deepspeed.name"), ("peft", "peft.name"), ("seed", "seed"),
)
_BUILT_ONLY = {"model.name", "model.hidden_size", "model.width_mult", "model.parametrization",
               "model.num_hidden_layers"}
"""What describes a model built from the fields: a pretrained one (model.name_or_path) has its own, left out."""


def settings_rows(cfg: dict) -> list[tuple[str, str]]:
    """The settings that decide how training behaves, as (label, value) rows; unset ones left out."""
    unused = _BUILT_ONLY if read.config_value(cfg, "model.name_or_path") is not None else set()
    return [(label, fmt(value)) for label, key in _SETTINGS
            if key not in unused and (value := read.config_value(cfg, key)) is not None]


def _with_auto_batch(cfg: dict, records: list[dict]) -> dict:
    """batch_size=auto shows the micro-batch the run chose (its last `start` record says which)."""
    starts = [r for r in records if r.get("event") == "start" and "batch_size" in r]
    if str(cfg.get("batch_size")).strip().lower() != "auto" or not starts:
        return cfg
    return {**cfg, "batch_size": f"auto: {starts[-1]['batch_size']}"}


def findings_markdown(findings: list[dict]) -> str:
    if not findings:
        return "None: the run looks healthy.\n"
    icon = {"error": "🛑", "warning": "⚠️", "info": "ℹ️"}
    lines = []
    for f in findings:
        state = finding_state(f)
        lines.append(f"- {icon.get(f['severity'], '') if not state else '✅'} **{f['severity']}** `{f['kind']}` at "
                     f"step {f['step']}{f' **{state.strip()}**' if state else ''}: "
                     f"{f['message']}\n  - *advice:* {f['advice']}")
    return "\n".join(lines) + "\n"


def samples_markdown(records: list[dict]) -> str:
    """The first and the last samples side by side: what training changed in the model's continuations."""
    events = [r for r in records if r.get("event") == "sample" and isinstance(r.get("samples"), list)]
    if not events:
        return ""
    first, last = events[0], events[-1]
    both = last is not first
    header = ["prompt", f"step {first['step']}", *([f"step {last['step']}"] if both else [])]
    rows = [[md_cell(a["prompt"]), md_cell(a["completion"])] + ([md_cell(b["completion"])] if both else [])
            for a, b in zip(first["samples"], last["samples"], strict=False)]
    return "## Samples\n\n" + _table(header, rows)


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
        parts.append(f"**{task}** ({kinds.get(task, '')}), by eval step: `tasks/{task}/<metric>`\n")
        parts.append(_table(["metric", *(f"step {s}" for s in steps)],
                            ([m, *(fmt(by_step[s].get(m), 4) for s in steps)] for m in points[-1][1])))
        parts.append(_examples(records, task))
    return "\n".join(p for p in parts if p)


def _examples(records: list[dict], task: str) -> str:
    last = next((r for r in reversed(task_records(records)) if r["task"] == task and r.get("examples")), None)
    if last is None:
        return ""
    return f"Examples at step {last['step']}:\n\n" + _table(["prompt", "completion", "target"], (
        [md_cell(e["prompt"]), md_cell(e["completion"]), md_cell(e["target"])] for e in last["examples"]))


def _table(header: list[str], rows: Iterable[Sequence[str]]) -> str:
    return "\n".join(md_table(header, rows)) + "\n"


DAMAGED_SUMMARY = "failed (summary.json is damaged)"
"""A run's status when its summary.json is there but unreadable: failed, as the status table and the sweep report
call it."""


def run_report_markdown(run_dir: Path, records: list[dict], summary: dict | None, findings: list[dict],
                        cfg: dict, overrides: list[str]) -> str:
    status = DAMAGED_SUMMARY if read.summary_damaged(run_dir, summary) else (summary or {}).get(
        "status", "unknown (no summary.json: the run was killed or is still running)")
    worst = worst_severity(findings)
    health = "healthy" if worst is None or worst == "info" else ("broken" if worst == ERROR else "needs attention")
    still = [f for f in findings if is_open(f)]
    counts = ", ".join(f"{sum(f['severity'] == s for f in still)} {s}" for s in ("error", "warning", "info"))
    if len(still) < len(findings):
        counts += f"; {len(findings) - len(still)} resolved"
    parts = [
        f"# Run report: {Path(run_dir).resolve().name}\n",
        f"**Status:** {status}" + (f" (exit code {summary['exit_code']})" if summary and "exit_code" in summary else "")
        + f" · **health:** {health} ({counts})\n",
        f"**Overrides:** `{' '.join(overrides)}`\n" if overrides else "**Overrides:** none (the default run)\n",
        "## Key metrics\n", _table(["metric", "value"], _key_metrics(records, summary or {})),
        "## Findings\n", findings_markdown(findings),
        "## Settings that mattered\n",
        _table(["setting", "value"], settings_rows(_with_auto_batch(cfg, records))) if cfg
        else "No `.hydra/config.yaml` found.\n",
        samples_markdown(records), tasks_markdown(records),
        "## Curves\n", "![curves](curves.png)\n",
        "Regenerate with `python -m llmexp.doctor RUN_DIR`.\n",
    ]
    return "\n".join(p for p in parts if p)  # (no samples or tasks: no section)


def write_run_report(run_dir: Path, findings: list[dict] | None = None) -> None:
    """Write report.md and curves.png from metrics.jsonl, summary.json and .hydra/; `findings` defaults to a fresh
    diagnosis of metrics.jsonl (or summary.json's when there are no metrics)."""
    from llmexp.report.plots import plot_run

    run_dir = Path(run_dir)
    records = read.load_records(run_dir)
    found = run_findings(run_dir, records) if findings is None else findings
    cfg = read.load_config(run_dir)
    text = run_report_markdown(run_dir, records, read.load_summary(run_dir), found, cfg, read.load_overrides(run_dir))
    clip = read.config_value(cfg, "train.max_grad_norm")
    plot_run(records, found, run_dir / "curves.png", title=run_dir.resolve().name,
             max_grad_norm=float(clip) if isinstance(clip, int | float) else None)
    write_text_atomic(run_dir / "report.md", text)
