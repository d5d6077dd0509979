"""A run's findings as its reports show them: re-diagnosed from its metrics by the detectors the trainer
ran live, each with its state (open, resolved, superseded)."""

from __future__ import annotations

from pathlib import Path

from llmexp.monitor.detectors import DETECTOR_KINDS, reconcile, settings_from_config
from llmexp.rundir import read


def run_findings(run_dir: Path, records: list[dict]) -> list[dict]:
    """A run's findings as summary.json holds them (`monitor.reconcile`): every finding the trainer printed kept
    (open, resolved or superseded), plus any of summary.json's of a kind the detectors do not produce."""
    summary = read.load_summary(run_dir) or {}
    if not records:
        return [f for f in summary.get("findings", []) if isinstance(f, dict)]
    lr, precision = summary.get("lr"), summary.get("precision")  # what the run resolved `auto` to
    settings = settings_from_config(read.load_config(run_dir), lr=float(lr) if isinstance(lr, int | float) else None,
                                    precision=precision if isinstance(precision, str) else None)
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
