"""`python -m llmexp.status` on hand-made run and sweep directories (the files a run leaves behind): the fast
cases, beside tests/test_status.py's real sweep."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from llmexp.report.status import rows
from tests.conftest import run_cli
from tests.test_report import make_grid, make_run, write_multirun


def dead_pid() -> int:
    """The pid of a process that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def leave_a_failed_start(run_dir: Path) -> Path:
    """What a run leaves that stopped on a user's mistake found after Hydra made its directory (an empty data
    file: exit 2): `.hydra/`, an empty metrics.jsonl and llmexp.log, and its lock, its process gone."""
    make_run(run_dir, [], None, ("data=json", "data.train_file=/data/empty.json"))
    (run_dir / "llmexp.log").write_text("")
    (run_dir / ".llmexp.lock").write_text(str(dead_pid()))
    return run_dir


def test_a_run_that_stopped_as_it_started_is_failed_not_queued(tmp_path: Path) -> None:
    (row,) = rows(leave_a_failed_start(tmp_path / "run"))
    assert row.status == "failed"
    sweep = tmp_path / "sweep"
    write_multirun(sweep, ["seed=0,1"])
    leave_a_failed_start(sweep / "0")  # (its launcher gone before it wrote the job's verdict)
    make_run(sweep / "1", [], None, ("seed=1",))  # no lock: not started
    assert {r.job: r.status for r in rows(sweep)} == {"0": "failed", "1": "queued"}


def test_the_status_lists_a_launched_job_whose_directory_is_gone(tmp_path: Path) -> None:
    sweep = make_grid(tmp_path / "sweep", ["lr=1e-3,2e-3", "seed=0,1"],
                      {"0": ("lr=0.001", "seed=0"), "1": ("lr=0.001", "seed=1"), "3": ("lr=0.002", "seed=1")})
    proc = run_cli([str(sweep)], module="llmexp.status", timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].endswith(": 4 jobs (3 completed, 1 missing)")
    assert lines[4].split() == ["2", "lr=0.002", "seed=0", "missing", "–/–", "–", "–", "–", "–"]


def test_the_status_shows_the_swept_keys_where_the_jobs_repeat_a_value(tmp_path: Path) -> None:
    sweep = make_grid(tmp_path / "sweep", ["lr=1e-3,1e-3", "seed=0,1"],
                      {"0": ("lr=0.001", "seed=0"), "1": ("lr=0.001", "seed=1"),
                       "2": ("lr=0.001", "seed=0"), "3": ("lr=0.001", "seed=1")})
    assert [r.overrides for r in rows(sweep)] == ["lr=0.001 seed=0", "lr=0.001 seed=1"] * 2
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {}}))  # no record: the jobs alone tell
    assert [r.overrides for r in rows(sweep)] == ["seed=0", "seed=1"] * 2
