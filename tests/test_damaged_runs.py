"""The read-only tools (`llmexp.status`, `llmexp.report`, `llmexp.doctor`) and a sweep's rerun survive damaged run
files: each damage is skipped with one line saying so, nothing hangs or runs out of memory; and the tools that read
one truth agree with the sweep (its exit code, a running job, the never-started jobs of a killed sweeper).

The run and sweep directories are written here as a run writes them (no training: the readers are what is
tested), then damaged; a representative set goes through the command line, the rest in-process."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

from llmexp.report import doctor, status
from llmexp.report.__main__ import main as report_main
from llmexp.rundir import readers
from llmexp.rundir.lock import LOCK_NAME
from llmexp.sweep.jobs import JobSpec, ended_before
from tests.conftest import as_nobody, run_cli

FINDING = {"kind": "loss_spike", "step": 2, "severity": "warning", "message": "the loss jumped", "advice": "lower lr"}


def write_run(run_dir: Path, status_: str | None = "completed", lr: str = "1e-3", loss: float = 2.0) -> Path:
    """A run directory as a finished (or, with `status_=None`, a killed) run leaves it."""
    (run_dir / ".hydra").mkdir(parents=True)
    records = [{"step": 0, "event": "start", "max_steps": 4}, {"step": 0, "event": "eval", "eval_loss": 3.0}]
    records += [{"step": s, "event": "train", "loss": loss + 1 / s, "time_s": s / 10, "lr": 1e-3} for s in range(1, 5)]
    records.append({"step": 4, "event": "eval", "eval_loss": loss})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"lr={lr}"]))
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"lr": float(lr), "train": {"max_steps": 4}}))
    if status_ is not None:
        (run_dir / "summary.json").write_text(json.dumps({
            "status": status_, "step": 4, "train_loss": loss, "eval_loss": loss if status_ != "diverged" else None,
            "eval_ppl": 7.4, "findings": [FINDING], "overrides": [f"lr={lr}"]}))
    return run_dir


def write_sweep(sweep_dir: Path, statuses: tuple[str | None, ...] = ("completed", "completed")) -> Path:
    sweep_dir.mkdir(parents=True)
    lrs = [f"{i + 1}e-3" for i in range(len(statuses))]
    (sweep_dir / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": [
        f"lr={','.join(lrs)}"]}}}))
    for i, (st, lr) in enumerate(zip(statuses, lrs, strict=True)):
        write_run(sweep_dir / str(i), st, lr=lr, loss=2.0 + i)
    return sweep_dir


# ----------------------------------------------------------------------------- the damages of issue 40, failure 6


def _nest(path: Path) -> None:
    path.write_text("[" * 100_000 + "]" * 100_000 if path.suffix != ".yaml" else "- " * 5000 + "x")


DAMAGES: dict[str, Callable[[Path], None]] = {
    "deep nesting": _nest,
    "a 6,000-digit integer": lambda p: p.write_text('{"step": 1' + "0" * 6000 + "}\n" if p.suffix != ".yaml"
                                                   else "- 1" + "0" * 6000 + "\n"),
    "not UTF-8": lambda p: p.write_bytes(p.read_bytes()[:20] + b"\xff\xfe\xfa\n" + p.read_bytes()[20:]),
    "a FIFO": lambda p: (p.unlink(), os.mkfifo(p)),
    "a link to /dev/zero": lambda p: (p.unlink(), p.symlink_to("/dev/zero")),
    "a directory": lambda p: (p.unlink(), p.mkdir()),
    "a symlink loop": lambda p: (p.unlink(), p.symlink_to(p)),
}
WRONG_TYPES: dict[str, Callable[[Path], None]] = {  # (valid JSON, wrong-typed fields)
    "summary.json": lambda p: p.write_text(json.dumps({"status": "completed", "step": "four", "eval_loss": [1],
                                                       "findings": [{"kind": "k", "step": 1}, 7]})),
    "job_status.json": lambda p: p.write_text(json.dumps({"status": 3, "overrides": "lr=1"})),
    "metrics.jsonl": lambda p: p.write_text('{"step": "1", "event": "train"}\n{"step": null}\n{"event": "eval"}\n[]\n'),
}
FILES = ("metrics.jsonl", "summary.json", ".hydra/config.yaml", ".hydra/overrides.yaml", "job_status.json")


@pytest.fixture(scope="module")
def damaged_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep of one healthy job and one job per damage, every run file of that job damaged alike (wrong-typed
    fields: the JSON files)."""
    sweep_dir = write_sweep(tmp_path_factory.mktemp("damaged") / "sweep", ("completed",) * (1 + len(DAMAGES) + 1))
    for num, damage in enumerate([*DAMAGES.values(), None], start=1):
        job_dir = sweep_dir / str(num)
        (job_dir / "job_status.json").write_text(json.dumps({"status": "failed", "exit_code": 1, "error": "e",
                                                            "overrides": [f"lr={num + 1}e-3"]}))
        for file in FILES if damage is not None else WRONG_TYPES:
            (damage or WRONG_TYPES[file])(job_dir / file)
    return sweep_dir


def damaged_files(sweep_dir: Path) -> dict[str, Path]:
    """What damage, which file: every damaged file of the sweep."""
    names = [*DAMAGES, "wrong-typed fields"]
    return {f"{names[num - 1]}: {file}": sweep_dir / str(num) / file for num in range(1, len(names) + 1)
            for file in (FILES if num <= len(DAMAGES) else WRONG_TYPES)}


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "llmexp.readers"]


def _each_said_once(said: list[str], files: dict[str, Path]) -> None:
    assert all(line.startswith("llmexp: skipped ") for line in said), said
    for what, path in files.items():
        lines = [line for line in said if f" {path}:" in line or f" {path} (" in line]
        assert len(lines) == 1, f"{what}: {lines or said}"


def test_status_and_report_skip_each_damaged_file_in_one_line(damaged_sweep: Path, capsys: pytest.CaptureFixture[str],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    readers._said.clear()
    assert status.main([str(damaged_sweep)]) == 0
    table = capsys.readouterr().out
    assert all(f"\n{num}  " in table for num in range(len(DAMAGES) + 2)), table  # every job has its line
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line[:1].isdigit()}
    damaged = [name for num, name in enumerate(DAMAGES, 1) if "failed" not in rows[str(num)]]
    assert not damaged, f"a damaged summary.json is a failed run, as the report says: {damaged}\n{table}"
    _each_said_once(_said(caplog), {w: p for w, p in damaged_files(damaged_sweep).items() if p.name != "config.yaml"})
    readers._said.clear()  # (status reads no config.yaml)
    caplog.clear()
    assert report_main([str(damaged_sweep)]) == 1  # (jobs with no readable summary did not end by themselves)
    _each_said_once(_said(caplog), damaged_files(damaged_sweep))
    assert (damaged_sweep / "sweep_report.md").is_file()


@pytest.mark.parametrize("num", range(1, len(DAMAGES) + 2), ids=[*DAMAGES, "wrong-typed fields"])
def test_doctor_and_a_rerun_skip_each_damaged_file(num: int, damaged_sweep: Path, capsys: pytest.CaptureFixture[str],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    job_dir = damaged_sweep / str(num)
    readers._said.clear()
    damaged = num <= len(DAMAGES)  # summary.json unreadable: a failed run (exit 1), as `status` calls it
    assert doctor.main([str(job_dir)]) == (1 if damaged else 0)
    out = capsys.readouterr().out
    assert "report.md" in out and ("status failed (summary.json is damaged)" in out) == damaged, out
    assert ("**Status:** failed (summary.json is damaged)" in (job_dir / "report.md").read_text()) == damaged
    rerun = ended_before(JobSpec(num, [f"lr={num + 1}e-3"], None, job_dir))  # what a rerun makes of the job
    assert rerun is None if num <= len(DAMAGES) else rerun.status == "completed"  # (its summary's status is whole)
    said = _said(caplog)
    assert said and all(line.startswith("llmexp: skipped ") for line in said), said
    assert len(said) == len(set(said)), said  # each damaged file said once


def test_status_of_a_fifo_in_place_of_summary_or_job_status_answers_at_once(tmp_path: Path) -> None:
    """Through the command line: status used to wait forever for a writer of the FIFO."""
    sweep_dir = write_sweep(tmp_path / "sweep")
    for name in ("summary.json", "job_status.json"):
        (sweep_dir / "1" / name).unlink(missing_ok=True)
        os.mkfifo(sweep_dir / "1" / name)
    result = run_cli([str(sweep_dir)], module="llmexp.status", timeout_s=60)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    for name in ("summary.json", "job_status.json"):
        assert f"skipped {sweep_dir / '1' / name}: it is a FIFO, not a file" in result.stderr, result.stderr


def test_report_and_doctor_through_the_cli_on_dev_zero_and_a_report_md_directory(tmp_path: Path) -> None:
    sweep_dir = write_sweep(tmp_path / "sweep")
    metrics = sweep_dir / "0" / "metrics.jsonl"
    metrics.unlink()
    metrics.symlink_to("/dev/zero")
    result = run_cli([str(sweep_dir)], module="llmexp.report", timeout_s=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"skipped {metrics}: it is a device, not a file" in result.stderr, result.stderr
    (sweep_dir / "1" / "report.md").mkdir()
    result = run_cli([str(sweep_dir / "1")], module="llmexp.doctor", timeout_s=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "report.md not written: cannot write in" in result.stdout and "Is a directory" in result.stdout, \
        result.stdout
    result = run_cli([str(sweep_dir / "1")], module="llmexp.report", timeout_s=120)
    assert result.returncode == 1 and "llmexp.report: error: cannot write in" in result.stderr, result.stderr


def test_watch_inf_and_a_directory_named_in_bytes(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / os.fsdecode(b"run-\xff\xfe"))
    result = run_cli([str(tmp_path / "x"), "--watch", "inf"], module="llmexp.status", timeout_s=60)
    assert result.returncode == 2 and "--watch and --scheduler-timeout take a number" in result.stderr, result.stderr
    result = run_cli([str(run_dir)], module="llmexp.status", timeout_s=60)
    assert result.returncode == 0 and "completed" in result.stdout and "Traceback" not in result.stderr, result
    assert doctor.main([str(run_dir)]) == 0 and report_main([str(run_dir)]) == 0


def test_a_read_only_run_directory(capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(shutil.os.path.realpath("/tmp")) / f"llmexp-ro-{os.getpid()}"
    try:
        run_dir = write_run(root / "run")
        assert doctor.main([str(run_dir)]) == 0  # once as root: every import and font cache in place
        for path in (root, run_dir, run_dir / ".hydra"):
            path.chmod(0o555)
        for path in run_dir.rglob("*"):
            path.chmod(0o555 if path.is_dir() else 0o444)
        capsys.readouterr()
        with as_nobody():
            assert doctor.main([str(run_dir)]) == 0
            assert report_main([str(run_dir)]) == 1
        out, err = capsys.readouterr()
        assert "report.md not written: cannot write in" in out and "Permission denied" in out, out
        assert "llmexp.report: error: cannot write in" in err and "Traceback" not in err, err
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ----------------------------------------------------------------------------- two readers of one truth


def test_report_exits_as_the_sweep_did_with_one_diverged_job(tmp_path: Path) -> None:
    """A finished sweep with a diverged job ended 0 (a diverged lr is an answer): so does its report."""
    sweep_dir = write_sweep(tmp_path / "sweep", ("completed", "diverged"))
    assert report_main([str(sweep_dir)]) == 0
    everyone = write_sweep(tmp_path / "all", ("diverged", "diverged"))
    assert report_main([str(everyone)]) == 3  # no job completed, one diverged: the sweep's 3


def test_the_report_says_a_summary_is_damaged_not_missing(tmp_path: Path) -> None:
    """A summary.json that is there but unreadable is not 'no summary.json: killed or crashed'."""
    sweep_dir = write_sweep(tmp_path / "sweep", ("completed", "completed"))
    (sweep_dir / "1" / "summary.json").write_text("[1, 2]")
    (sweep_dir / "0" / "summary.json").unlink()
    report_main([str(sweep_dir)])
    jobs = json.loads((sweep_dir / "sweep_summary.json").read_text())["jobs"]
    assert jobs[0]["error"] == "no summary.json: the job was killed or crashed"
    assert jobs[1]["error"] == f"{sweep_dir / '1' / 'summary.json'} is damaged (not a JSON object)"


def test_mid_sweep_the_report_calls_a_running_job_running(tmp_path: Path) -> None:
    sweep_dir = write_sweep(tmp_path / "sweep", ("completed", None))
    lock = FileLock(str(sweep_dir / "1" / LOCK_NAME))  # this process trains job 1, as far as anyone can tell
    with lock:
        assert report_main([str(sweep_dir)]) == 1  # the sweep has not ended: not 0
        summary = json.loads((sweep_dir / "sweep_summary.json").read_text())
        assert [j["status"] for j in summary["jobs"]] == ["completed", "running"]
    report_main([str(sweep_dir)])
    summary = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [j["status"] for j in summary["jobs"]] == ["completed", "failed"]  # nobody holds it: killed


def test_status_tells_a_dead_sweepers_never_started_jobs_from_queued_ones(tmp_path: Path) -> None:
    sweep_dir = write_sweep(tmp_path / "sweep", ("completed",))
    waiting = sweep_dir / "1"
    (waiting / ".hydra").mkdir(parents=True)
    (waiting / "job_status.json").write_text(json.dumps({"num": 1, "status": "queued", "exit_code": None,
                                                        "error": "waiting for a free slot", "overrides": ["lr=9"]}))
    with FileLock(str(sweep_dir / LOCK_NAME)):  # the sweeper, alive
        assert {r.job: r.status for r in status.rows(sweep_dir)} == {"0": "completed", "1": "queued"}
    assert {r.job: r.status for r in status.rows(sweep_dir)} == {"0": "completed", "1": "not_started"}
    report_main([str(sweep_dir)])  # the report agrees (it said "queued (waiting for a free slot)")
    jobs = json.loads((sweep_dir / "sweep_summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["completed", "not_started"] and "sweeper stopped" in jobs[1]["error"]
