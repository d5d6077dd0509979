"""Run and sweep reports: pure functions of what a run directory holds, so they work after the fact.

    python -m llmexp.report RUN_DIR      # report.md + curves.png
    python -m llmexp.report SWEEP_DIR    # sweep_summary.json, sweep_report.md, sweep_curves.png

A run directory has `metrics.jsonl` / `summary.json` / `.hydra/`; a sweep directory has
`multirun.yaml` or job subdirectories (`0/`, `1/`, ...). Plots live in `llmexp.plots`, the sweep
report in `llmexp.sweep_report` (its names are re-exported here).
Exit codes: 0 written, 1 a sweep with failed or unfinished jobs, 2 not a run or sweep directory.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from llmexp.monitor import DETECTOR_KINDS, ERROR, Finding, diagnose, settings_from_config, worst_severity

FINISHED = ("completed", "early_stopped")


# ----- reading a run directory -----------------------------------------------------------------

def load_records(run_dir: Path) -> list[dict]:
    """The records of metrics.jsonl; a torn last line (a killed run) is skipped, not fatal."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            records.append(rec)
    return records


def load_json(path: Path) -> dict | None:
    """A JSON object from disk, or None when it is missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def load_config(run_dir: Path) -> dict:
    """`.hydra/config.yaml` as plain data (interpolations left as strings); {} when absent."""
    import yaml

    try:
        data = yaml.safe_load((Path(run_dir) / ".hydra" / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def load_overrides(run_dir: Path) -> list[str]:
    """The command-line overrides of a run (`.hydra/overrides.yaml`), else those in summary.json."""
    import yaml

    try:
        data = yaml.safe_load((Path(run_dir) / ".hydra" / "overrides.yaml").read_text())
    except (OSError, yaml.YAMLError):
        data = (load_json(Path(run_dir) / "summary.json") or {}).get("overrides")
    from llmexp.security import scrub_overrides

    return scrub_overrides([str(o) for o in data]) if isinstance(data, list) else []


def is_run_dir(path: Path) -> bool:
    path = Path(path)
    return any((path / name).exists() for name in ("metrics.jsonl", "summary.json", ".hydra/config.yaml"))


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Job subdirectories of a sweep, in job-number order (non-numeric names after, by name)."""
    found = [p for p in Path(sweep_dir).iterdir()
             if p.is_dir() and (is_run_dir(p) or (p / "job_status.json").is_file())]
    return sorted(found, key=lambda p: (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name))


def is_sweep_dir(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and ((path / "multirun.yaml").is_file() or bool(job_dirs(path)))


def run_findings(run_dir: Path, records: list[dict] | None = None) -> list[dict]:
    """Findings of a run: re-diagnosed from its metrics (the same detectors the trainer ran live),
    plus any of summary.json's of a kind the detectors do not produce."""
    run_dir = Path(run_dir)
    records = load_records(run_dir) if records is None else records
    summary = load_json(run_dir / "summary.json") or {}
    if not records:
        return [f for f in summary.get("findings", []) if isinstance(f, dict)]
    lr = summary.get("lr")
    settings = settings_from_config(load_config(run_dir), lr=float(lr) if isinstance(lr, int | float) else None)
    found = [f.to_dict() for f in diagnose(records, settings)]
    # Keep what only the trainer could know (e.g. rollbacks given up): kinds the detectors never produce.
    extra = [f for f in summary.get("findings", []) if isinstance(f, dict) and f.get("kind") not in DETECTOR_KINDS]
    return sorted(found + extra, key=lambda f: int(f.get("step", 0)))


# ----- writing atomically ------------------------------------------------------------------------

def write_atomic(path: Path, text: str) -> None:
    """Write text so that readers see the old file or the new one, never half of one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ----- the run report ----------------------------------------------------------------------------

def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and math.isfinite(value) and 0 < abs(value) < 1e-2:
        mantissa, exponent = f"{value:.{digits - 1}e}".split("e")  # learning rates: 3e-04, not 0.0003
        return f"{mantissa.rstrip('0').rstrip('.')}e{exponent}"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if math.isfinite(value) else str(value)
    return str(value)


def _fmt_rate(value: Any) -> str:
    return f"{value:,.0f}" if isinstance(value, int | float) and math.isfinite(value) else _fmt(value)


def _last(records: list[dict], event: str, key: str) -> Any:
    return next((r[key] for r in reversed(records) if r.get("event") == event and key in r), None)


def _key_metrics(records: list[dict], summary: dict) -> list[tuple[str, str]]:
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("event") == "eval"
             and isinstance(r.get("eval_loss"), int | float) and math.isfinite(r["eval_loss"])]
    best = min(evals, key=lambda sv: sv[1]) if evals else None
    pick = lambda key, event="train": summary.get(key, _last(records, event, key))  # noqa: E731
    rows = [
        ("steps", _fmt(summary.get("step", _last(records, "train", "step")))),
        ("final train loss", _fmt(pick("train_loss") if "train_loss" in summary else _last(records, "train", "loss"))),
        ("final eval loss", _fmt(pick("eval_loss", "eval"))),
        ("final eval ppl", _fmt(pick("eval_ppl", "eval"))),
        ("best eval loss", f"{best[1]:.4g} (step {best[0]})" if best else "–"),
        ("tokens/s", _fmt_rate(pick("tokens_per_sec"))),
        ("MFU", _fmt(pick("mfu"), 3)),
        ("peak memory (MB)", _fmt(summary.get("peak_mem_mb", _last(records, "train", "mem_mb")))),
        ("wall time (s)", _fmt(summary.get("time_s", _last(records, "train", "time_s")))),
        ("parameters", _fmt(summary.get("num_params"))),
        ("lr", f"{_fmt(summary.get('lr'))} ({summary['lr_source']})" if summary.get("lr_source")
         else _fmt(summary.get("lr"))),
    ]
    return [(k, v) for k, v in rows if v != "–"]


_SETTINGS = (
    ("model", ("model", "name")), ("model path", ("model", "name_or_path")), ("hidden size", ("model", "hidden_size")),
    ("layers", ("model", "num_hidden_layers")), ("lr", ("lr",)), ("batch size (per device)", ("batch_size",)),
    ("gradient accumulation", ("train", "gradient_accumulation_steps")),
    ("global batch size", ("train", "global_batch_size")), ("max steps", ("train", "max_steps")),
    ("precision", ("precision", "name")), ("optimizer", ("optimizer", "name")),
    ("weight decay", ("train", "weight_decay")), ("scheduler", ("scheduler", "name")),
    ("warmup ratio", ("train", "warmup_ratio")), ("warmup steps", ("train", "warmup_steps")),
    ("max grad norm (clipping)", ("train", "max_grad_norm")), ("on anomaly", ("train", "on_anomaly")),
    ("early stopping patience", ("train", "early_stopping_patience")), ("data", ("data", "name")),
    ("max length", ("data", "max_length")), ("deepspeed", ("deepspeed", "name")), ("seed", ("seed",)),
)


def settings_rows(cfg: dict) -> list[tuple[str, str]]:
    """The settings that decide how training behaves, as (label, value) rows; unset ones left out."""
    rows = []
    for label, keys in _SETTINGS:
        node: Any = cfg
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            rows.append((label, _fmt(node)))
    return rows


def findings_markdown(findings: list[dict]) -> str:
    if not findings:
        return "None: the run looks healthy.\n"
    icon = {"error": "🛑", "warning": "⚠️", "info": "ℹ️"}
    lines = []
    for f in findings:
        lines.append(f"- {icon.get(f['severity'], '')} **{f['severity']}** `{f['kind']}` at step {f['step']}: "
                     f"{f['message']}\n  - *advice:* {f['advice']}")
    return "\n".join(lines) + "\n"


def _table(rows: list[tuple[str, str]], header: tuple[str, str]) -> str:
    out = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(out) + "\n"


def run_report_markdown(run_dir: Path, records: list[dict], summary: dict | None, findings: list[dict],
                        cfg: dict, overrides: list[str]) -> str:
    status = (summary or {}).get("status", "unknown (no summary.json: the run was killed or is still running)")
    worst = worst_severity(findings)
    health = "healthy" if worst is None or worst == "info" else ("broken" if worst == ERROR else "needs attention")
    counts = ", ".join(f"{sum(f['severity'] == s for f in findings)} {s}" for s in ("error", "warning", "info"))
    parts = [
        f"# Run report: {Path(run_dir).resolve().name}\n",
        f"**Status:** {status}" + (f" (exit code {summary['exit_code']})" if summary and "exit_code" in summary else "")
        + f" · **health:** {health} ({counts})\n",
        f"**Overrides:** `{' '.join(overrides)}`\n" if overrides else "**Overrides:** none (the default run)\n",
        "## Key metrics\n", _table(_key_metrics(records, summary or {}), ("metric", "value")),
        "## Findings\n", findings_markdown(findings),
        "## Settings that mattered\n",
        _table(settings_rows(cfg), ("setting", "value")) if cfg else "No `.hydra/config.yaml` found.\n",
        "## Curves\n", "![curves](curves.png)\n",
        "Regenerate with `python -m llmexp.doctor RUN_DIR`.\n",
    ]
    return "\n".join(parts)


def write_run_report(run_dir: Path, findings: list[Finding] | list[dict] | None = None) -> None:
    """Write report.md and curves.png from metrics.jsonl, summary.json and .hydra/.

    `findings` defaults to a fresh diagnosis of metrics.jsonl (or summary.json's when there are no metrics).
    """
    from llmexp.plots import plot_run

    run_dir = Path(run_dir)
    records = load_records(run_dir)
    if findings is None:
        found = run_findings(run_dir, records)
    else:
        found = [f.to_dict() if isinstance(f, Finding) else dict(f) for f in findings]
    cfg = load_config(run_dir)
    text = run_report_markdown(run_dir, records, load_json(run_dir / "summary.json"), found, cfg,
                               load_overrides(run_dir))
    clip = (cfg.get("train") or {}).get("max_grad_norm")
    plot_run(records, found, run_dir / "curves.png", title=run_dir.resolve().name,
             max_grad_norm=float(clip) if isinstance(clip, int | float) else None)
    write_atomic(run_dir / "report.md", text)


# ----- the sweep report (llmexp.sweep_report) ------------------------------------------------------

_SWEEP_NAMES = frozenset({"REPLICATE_KEYS", "collect_job", "recommend", "stability", "sweep_report_markdown",
                          "varying_params", "write_sweep_report"})


def __getattr__(name: str) -> Any:
    """`from llmexp.report import write_sweep_report` (and the other sweep names) still works.

    Resolved on first use: llmexp.sweep_report imports this module's loaders at its top, so
    importing it here at load time would be a cycle.
    """
    if name in _SWEEP_NAMES:
        from llmexp import sweep_report

        return getattr(sweep_report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    """`python -m llmexp.report DIR`: the run report or the sweep report, whichever DIR is."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: python -m llmexp.report RUN_DIR|SWEEP_DIR", file=sys.stderr)
        return 2
    path = Path(args[0])
    if is_sweep_dir(path) and not (path / "metrics.jsonl").exists():
        from llmexp.sweep_report import write_sweep_report

        summary = write_sweep_report(path)
        rec = summary["recommendation"]
        print(f"wrote {path / 'sweep_report.md'}: {summary['num_jobs']} jobs {summary['status_counts']}")
        print(f"recommended: {rec['settings']} ({rec['reason']})" if rec else "no recommendation")
        return 0 if summary["all_finished"] else 1
    if is_run_dir(path):
        write_run_report(path)
        print(f"wrote {path / 'report.md'} and {path / 'curves.png'}")
        return 0
    print(f"llmexp.report: error: {path} is neither a run directory (metrics.jsonl, summary.json, .hydra/) "
          "nor a sweep directory (multirun.yaml, job subdirectories)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
