"""Reading a run directory, and the value formats its reports share.

Pure functions of what a run (or sweep) directory holds: `metrics.jsonl`, `summary.json`,
`.hydra/`, job subdirectories. `llmexp.report.run` (one run), `llmexp.report.sweep` (a sweep) and
`llmexp.doctor` read through these, so a killed run, a finished one and a sweep job read alike.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from llmexp.monitor import DETECTOR_KINDS, reconcile, settings_from_config

FINISHED = ("completed", "early_stopped")
"""Statuses of a run that ended as intended."""


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
    except (OSError, ValueError):  # also a file of bytes that are not text (UnicodeDecodeError)
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
    from llmexp.redact import scrub_overrides

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
    """Findings of a run, as its summary.json holds them (`monitor.reconcile`): re-diagnosed from its
    metrics with the detectors the trainer ran live, every finding it printed kept (open, resolved or
    superseded), plus any of summary.json's of a kind the detectors do not produce."""
    run_dir = Path(run_dir)
    records = load_records(run_dir) if records is None else records
    summary = load_json(run_dir / "summary.json") or {}
    if not records:
        return [f for f in summary.get("findings", []) if isinstance(f, dict)]
    lr = summary.get("lr")
    settings = settings_from_config(load_config(run_dir), lr=float(lr) if isinstance(lr, int | float) else None)
    found = reconcile(records, settings)
    known = {(f["kind"], f["step"], f["severity"]) for f in found}
    # Keep what only the trainer could know (e.g. rollbacks given up): kinds the detectors never produce.
    extra = [f for f in summary.get("findings", []) if isinstance(f, dict) and f.get("kind") not in DETECTOR_KINDS
             and (f.get("kind"), f.get("step"), f.get("severity")) not in known]
    return sorted(found + extra, key=lambda f: int(f.get("step", 0)))


def finding_state(f: dict) -> str:
    """` (resolved at step N)` / ` (superseded at step N)` for a finding that no longer holds, else ''."""
    status = f.get("status", "open")
    if status == "open":
        return ""
    at = f.get("resolved_at")
    return f" ({status} at step {at})" if at is not None else f" ({status})"


# ----- formatting values ----------------------------------------------------------------------

def fmt(value: Any, digits: int = 4) -> str:
    """A value for a report's table: `–` when unknown, learning rates as 3e-04 rather than 0.0003."""
    if value is None:
        return "–"
    if isinstance(value, float) and math.isfinite(value) and 0 < abs(value) < 1e-2:
        mantissa, exponent = f"{value:.{digits - 1}e}".split("e")  # learning rates: 3e-04, not 0.0003
        return f"{mantissa.rstrip('0').rstrip('.')}e{exponent}"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if math.isfinite(value) else str(value)
    return str(value)


def fmt_rate(value: Any) -> str:
    """A throughput (tokens/s): whole numbers with thousands separators read at a glance."""
    return f"{value:,.0f}" if isinstance(value, int | float) and math.isfinite(value) else fmt(value)


def last_value(records: list[dict], event: str, key: str) -> Any:
    """The newest `key` among `event` records: what a run without summary.json (killed) last logged."""
    return next((r[key] for r in reversed(records) if r.get("event") == event and key in r), None)
