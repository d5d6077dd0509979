"""Reading a run directory, and the value formats its reports share.

Pure functions of what a run (or sweep) directory holds: `metrics.jsonl`, `summary.json`,
`.hydra/`, job subdirectories. `llmexp.report.run` (one run), `llmexp.report.sweep` (a sweep) and
`llmexp.report.doctor` read through these, so a killed run, a finished one and a sweep job read alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    from llmexp.rundir.redact import scrub_overrides

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


# ----- formatting values ----------------------------------------------------------------------


def last_value(records: list[dict], event: str, key: str) -> Any:
    """The newest `key` among `event` records: what a run without summary.json (killed) last logged."""
    return next((r[key] for r in reversed(records) if r.get("event") == event and key in r), None)


def swept_keys(sweep_dir: Path) -> list[str]:
    """The keys a sweep varies (`lr=1e-4,3e-4`, `lr=tag(log,interval(...))`, `optimizer=adamw,lion`), in the
    order given, read from the command its `multirun.yaml` recorded with Hydra's own override parser."""
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        data = yaml.safe_load((Path(sweep_dir) / "multirun.yaml").read_text())
        task = data["hydra"]["overrides"]["task"]
        overrides = OverridesParser.create().parse_overrides([str(o) for o in task])
    except (OSError, yaml.YAMLError, KeyError, TypeError, HydraException):
        return []
    return [o.get_key_element().lstrip("+~") for o in overrides if o.is_sweep_override()]
