"""Reading a run or sweep directory, and how a sweep's jobs ended: pure functions of its files, so the reports
and the doctor read a killed run, a finished one and a sweep job alike.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmexp.errors import EXIT_DIVERGED, EXIT_ERROR, EXIT_OK, EXIT_USER
from llmexp.rundir.lock import lock_holder
from llmexp.rundir.readers import (
    METRIC,
    Damaged,
    check_fields,
    entry_of,
    load_json,
    parse_json,
    read_lines,
    read_yaml,
    reader,
    skipped,
)
from llmexp.rundir.task_metrics import metric_value

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

FINISHED = ("completed", "early_stopped")
"""Statuses of a run that ended as intended."""


@reader
def read_metrics(path: Path) -> list[dict]:
    """The records of metrics.jsonl, each with an integer `step`; a line that is not one (a torn last line of a
    killed run, damage) is skipped, and the skipped lines are counted in one line."""
    records: list[dict] = []
    bad: list[Damaged] = []
    number = 0
    for number, line in read_lines(path, entry_of(read_metrics).max_line_bytes):
        try:
            if isinstance(line, Damaged):
                raise line
            if line.strip():
                rec, problems = check_fields(parse_json(line, path, number), METRIC)
                if rec is None or problems:
                    raise Damaged(path, f"not a record: {problems[0]}", number)
                records.append(rec)
        except Damaged as err:
            bad.append(err)
    if bad:
        skipped(f"{len(bad)} of {number} lines of {path} (line {bad[0].line}: {bad[0].why})")
    return records


@reader
def read_summary(path: Path) -> dict | None:
    """summary.json: what the trainer wrote as the run ended."""
    return load_json(path, read_summary)


@reader
def read_job_status(path: Path) -> dict | None:
    """job_status.json: the launcher's verdict on a job, when it knows more than the trainer."""
    return load_json(path, read_job_status)


@reader
def read_slurm_jobs(path: Path) -> dict | None:
    """slurm_jobs.json: a SLURM sweep's job ids by job number."""
    return load_json(path, read_slurm_jobs)


def load_records(run_dir: Path) -> list[dict]:
    return read_metrics(Path(run_dir) / "metrics.jsonl") or []


def load_summary(run_dir: Path) -> dict | None:
    return read_summary(Path(run_dir) / "summary.json")


def summary_damaged(run_dir: Path, summary: dict | None) -> bool:
    """`summary` (what `load_summary` gave) is None though summary.json is there: damaged, as its reader said."""
    return summary is None and os.path.lexists(Path(run_dir) / "summary.json")


def load_job_status(run_dir: Path) -> dict:
    return read_job_status(Path(run_dir) / "job_status.json") or {}


def load_config(run_dir: Path) -> dict:
    """`.hydra/config.yaml` as plain data (interpolations left as strings); {} when absent."""
    data = read_yaml(Path(run_dir) / ".hydra" / "config.yaml")
    return data if isinstance(data, dict) else {}


def config_value(config: dict, key: str) -> Any:
    """The value at dotted `key` ("train.max_grad_norm") of a saved config (`load_config`); None where the file
    lacks it (a key newer than the run) or a section is not a mapping."""
    node: Any = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def load_overrides(run_dir: Path) -> list[str]:
    """The command-line overrides of a run (`.hydra/overrides.yaml`), else those in summary.json."""
    from llmexp.rundir.redact import scrub_overrides

    data = read_yaml(Path(run_dir) / ".hydra" / "overrides.yaml")
    if not isinstance(data, list):
        data = (load_summary(run_dir) or {}).get("overrides")
    return scrub_overrides([str(o) for o in data]) if isinstance(data, list) else []


INTERRUPTED = ("preempted", "cancelled", "submitted")
"""Run statuses of a job that did not end by itself: a search's trial stays RUNNING in the study, and a rerun
of the sweep resumes it."""

SLURM_END_STATUS = {"CANCELLED": "cancelled", "TIMEOUT": "timeout", "DEADLINE": "timeout", "OUT_OF_MEMORY": "failed",
                    "NODE_FAIL": "failed", "BOOT_FAIL": "failed", "FAILED": "failed", "PREEMPTED": "preempted"}
"""SLURM's final states (sacct's, e.g. "CANCELLED by 1000") of a job that left no verdict of its own, as a run
status. PREEMPTED (a partition that preempts by cancelling) is `preempted`, so a rerun resumes the job."""


def slurm_end_status(state: str) -> str | None:
    """The run status of a job SLURM ended in `state`; None for a state that is not final there."""
    return next((status for prefix, status in SLURM_END_STATUS.items() if state.startswith(prefix)), None)


@dataclass
class TrialResult:
    """What a trial's run directory says about how it ended."""

    status: str
    """completed, pruned, failed (diverged, or an error finding), crashed (ended without its metric, or raised), or
    running (no end yet: interrupted, or still going)."""
    value: float | None = None
    step: int | None = None
    reason: str | None = None
    user_error: bool = False
    """The trial exited 2: a mistake in the config or data, which every other trial would repeat."""


def read_result(job_dir: Path, metric: str = "eval_loss") -> TrialResult:
    """A trial's result from summary.json (and job_status.json where the launcher wrote one), its value `metric` at
    the end. A run that diverged or whose doctor found an error is `failed` with that finding as its reason: a
    result about the region, not a crash."""
    summary = load_summary(job_dir) or {}
    verdict = load_job_status(job_dir)
    status = verdict.get("status") or summary.get("status")
    if status is None or status in INTERRUPTED:
        return TrialResult("running")
    step = summary.get("step")
    errors = [f for f in summary.get("findings", []) if f.get("severity") == "error"]
    if errors or status == "diverged":
        reason = f"{errors[0]['kind']}: {errors[0]['message']}" if errors else "the run diverged"
        return TrialResult("failed", step=step, reason=reason)
    if status == "pruned":
        return TrialResult("pruned", step=step)
    if status in FINISHED and (value := metric_value(metric, summary, [])) is not None:
        return TrialResult("completed", value=value, step=step)
    reason = verdict.get("error") or (f"ended {status} without a finite {metric}" if status in FINISHED
                                      else f"ended {status}")
    return TrialResult("crashed", step=step, reason=str(reason), user_error=verdict.get("exit_code") == EXIT_USER)


def sweep_exit_code(results: Sequence[TrialResult]) -> int:
    """The exit code of a sweep, grid or search alike, from how each job ended (`read_result`): what each code means,
    and why a diverged job is an answer rather than a failure, is docs/how-to/sweeps.md's "Exit codes of a sweep"."""
    statuses = [r.status for r in results]
    if statuses and all(r.user_error for r in results):  # a mistake every job hit: the same command repeats it
        return EXIT_USER
    if not statuses or any(s in ("crashed", "running") for s in statuses):
        return EXIT_ERROR
    return EXIT_DIVERGED if "completed" not in statuses and "failed" in statuses else EXIT_OK


def is_run_dir(path: Path) -> bool:
    """Whether `path` holds a run's files (or something in their place: a damaged run is still a run)."""
    return any(os.path.lexists(Path(path) / name) for name in ("metrics.jsonl", "summary.json", ".hydra/config.yaml"))


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Job subdirectories of a sweep, in `job_order`."""
    found = [p for p in Path(sweep_dir).iterdir()
             if p.is_dir() and (is_run_dir(p) or os.path.lexists(p / "job_status.json"))]
    return sorted(found, key=lambda p: job_order(p.name))


def job_order(name: str) -> tuple[int, int, str]:
    """A job directory's place in a sweep: by job number, non-numeric names after, by name."""
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def is_sweep_dir(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and ((path / "multirun.yaml").is_file() or bool(job_dirs(path)))


def last_value(records: list[dict], event: str, key: str) -> Any:
    """The newest `key` among `event` records: what a run without summary.json (killed) last logged."""
    return next((r[key] for r in reversed(records) if r.get("event") == event and key in r), None)


def _recorded_overrides(sweep_dir: Path) -> tuple[dict, list[Override]]:
    """(multirun.yaml as plain data, the overrides its sweeper expanded: `hydra.sweeper.params`, then the command
    line's), parsed with Hydra's own parser; ({}, []) without a readable record."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    data = read_yaml(Path(sweep_dir) / "multirun.yaml")
    task = config_value(data, "hydra.overrides.task") if isinstance(data, dict) else None
    params = config_value(data, "hydra.sweeper.params") or {}
    if not isinstance(task, list) or not isinstance(params, dict):
        return {}, []
    try:
        return data, OverridesParser.create().parse_overrides([*(f"{k}={v}" for k, v in params.items()),
                                                               *(str(o) for o in task)])
    except HydraException:
        return {}, []


def swept_keys(sweep_dir: Path) -> list[str]:
    """The keys a sweep varies (`lr=1e-4,3e-4`, `lr=tag(log,interval(...))`, `optimizer=adamw,lion`), in the
    order given, read from the command its `multirun.yaml` recorded with Hydra's own override parser."""
    overrides = _recorded_overrides(sweep_dir)[1]
    return list(dict.fromkeys(o.get_key_element().lstrip("+~") for o in overrides if o.is_sweep_override()))


GRID_SWEEPERS = ("GridSweeper", "BasicSweeper")
"""The `hydra.sweeper._target_` class names of a grid, whose jobs the command alone fixes (llmexp's, Hydra's)."""
MAX_GRID_JOBS = 10_000
"""The most jobs a grid may have, and values a categorical may hold (`llmexp.sweep.space` refuses more, so
`launched_jobs` never expands more): listing the jobs of a typo like `seed=range(0,100000000)` takes minutes
and gigabytes."""


def override_axes(overrides: Sequence[Override], limit: int | None = None) -> dict[str, list[str]]:
    """key -> its `key=value` strings (at most `limit`), in command-line order, as Hydra's basic sweeper reads them."""
    return {o.get_key_element(): [f"{o.get_key_element()}={v}" for v in itertools.islice(
        o.sweep_string_iterator() if o.is_sweep_override() else [o.get_value_element_as_str()], limit)]
        for o in overrides}


def grid_product(axes: dict[str, list[str]], zip_keys: Sequence[str]) -> list[list[str]]:
    """Every job's overrides: the product of the axes (key -> its `key=value` strings) in command-line order, the
    `zip_keys` axes paired value by value (the caller checked they have as many values each)."""
    columns = [list(zip(*(axes[k] for k in zip_keys), strict=True)) if zip_keys and key == zip_keys[0]
               else [(v,) for v in values] for key, values in axes.items() if key not in zip_keys[1:]]
    return [[item for group in combo for item in group] for combo in itertools.product(*columns)]


def _recorded(data: dict, key: str) -> Any:
    """A sweeper setting of multirun.yaml, its `${sweep.x}` interpolation (how llmexp's `sweep=` maps it) followed."""
    value = config_value(data, key)
    if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
        value = config_value(data, value[2:-1])
    return value


def launched_jobs(sweep_dir: Path) -> dict[str, list[str]]:
    """Job directory name -> overrides, of every job a grid sweep launches, listed from its `multirun.yaml` as
    `llmexp.sweep.space.grid_jobs` lists them, so a job whose directory is gone is still known. With
    `sweep.lr_scaling` the lr is left out (its scaled value needs the job's config). {} for a search, a
    `hydra.sweep.subdir` other than the job number, or no readable record."""
    data, overrides = _recorded_overrides(sweep_dir)
    target = str(config_value(data, "hydra.sweeper._target_") or "BasicSweeper")  # (absent: Hydra's default)
    subdir = config_value(data, "hydra.sweep.subdir") or "${hydra.job.num}"
    if not target.endswith(GRID_SWEEPERS) or subdir != "${hydra.job.num}" or not overrides \
            or any(o.is_interval_sweep() for o in overrides):
        return {}
    zip_keys = [str(k) for k in _recorded(data, "hydra.sweeper.zip") or []]
    axes = override_axes(overrides, MAX_GRID_JOBS + 1)
    if math.prod(len(v) for k, v in axes.items() if k not in zip_keys[1:]) > MAX_GRID_JOBS \
            or len({len(axes.get(k, [])) for k in zip_keys}) > 1 or any(len(axes.get(k, [])) < 2 for k in zip_keys):
        return {}  # (a grid the sweeper refused: nothing was launched)
    jobs = grid_product(axes, zip_keys)
    if _recorded(data, "hydra.sweeper.lr_scaling") not in (None, "none"):
        jobs = [[o for o in job if not o.startswith("lr=")] for job in jobs]
    return {str(num): job for num, job in enumerate(jobs)}


def missing_status(sweep_dir: Path) -> str:
    """The status of a launched job without a directory: `queued` while the sweep's process holds the sweep
    directory (a later batch, not started yet), else `missing` (deleted; the sweep's command runs it again)."""
    return "queued" if lock_holder(sweep_dir) is not None else "missing"


def override_key(override: str) -> str:
    """`lr` of `lr=1e-3`, `+foo.bar=1` and `~foo`."""
    return override.lstrip("+~").partition("=")[0]


def varying_keys(jobs: Sequence[Sequence[str]], swept: Sequence[str] = ()) -> list[str]:
    """The keys that tell `jobs` (each a list of overrides) apart: `swept` (the sweep's own record of what it
    varies, `swept_keys`: it names a setting even where the jobs at hand repeat one value), then the keys whose
    values differ between the jobs, each once, in the order given."""
    settings = [{override_key(o): o for o in job} for job in jobs]
    differ = [k for k in dict.fromkeys(k for s in settings for k in s) if len({s.get(k) for s in settings}) > 1]
    return list(dict.fromkeys([*swept, *differ]))


def shown_overrides(job: Sequence[str], keys: Sequence[str]) -> str:
    """A job's overrides of `keys` (`varying_keys`), or all of them where no key tells the jobs apart (a single
    run, a sweep that repeats one setting)."""
    return " ".join(o for o in job if override_key(o) in keys) or " ".join(job)
