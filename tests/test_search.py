"""Sweeps that search (`sweep=random|tpe`, optuna) and sweeps that can be run again (grid and search).

The search space and the grid's paired axes are pure functions of Hydra's parsed overrides; how a trial
ended is a pure function of its run directory. The end-to-end tests run the real CLI, the real local
launcher, the real trainer and a real optuna study in the sweep directory: a search whose sweeper is
killed with SIGKILL and run again, and a grid interrupted with Ctrl-C and run again.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from llmexp.errors import UserError
from llmexp.rundir.study import STUDY_NAME, study_journal
from llmexp.sweep.search import TrialResult, read_result, returned_result, tell
from llmexp.sweep.space import (
    finite_grid,
    grid_jobs,
    lr_to_scale,
    probe_job,
    scale_lr,
    search_space,
    trial_overrides,
)
from tests.conftest import TINY, compose, read_metrics, run_cli


def parse(*args: str) -> list:
    return OverridesParser.create().parse_overrides(list(args))


# ----------------------------------------------------------------------------- grid: paired axes, lr scaling


def test_grid_is_the_product_and_zip_pairs_axes() -> None:
    assert grid_jobs(parse("lr=1,2", "batch_size=4,8", "seed=0"), []) == [
        ["lr=1", "batch_size=4", "seed=0"], ["lr=1", "batch_size=8", "seed=0"],
        ["lr=2", "batch_size=4", "seed=0"], ["lr=2", "batch_size=8", "seed=0"]]
    zipped = grid_jobs(parse("lr=1,2", "optimizer=adamw,lion", "batch_size=4,8"), ["lr", "batch_size"])
    assert zipped == [["lr=1", "batch_size=4", "optimizer=adamw"], ["lr=1", "batch_size=4", "optimizer=lion"],
                      ["lr=2", "batch_size=8", "optimizer=adamw"], ["lr=2", "batch_size=8", "optimizer=lion"]]


def test_a_zipped_grid_is_counted_as_the_jobs_it_launches() -> None:
    """Keys paired by sweep.zip make one axis: 101 lrs zipped with 101 seeds are 101 jobs, within MAX_GRID_JOBS
    (10,000), as `rundir.read.launched_jobs` counts them, not their 10,201-job product."""
    from llmexp.rundir.read import MAX_GRID_JOBS

    args = ("lr=range(1,102)", "seed=range(0,101)")
    assert len(grid_jobs(parse(*args), ["lr", "seed"])) == 101 < MAX_GRID_JOBS < 101 * 101
    with pytest.raises(UserError, match="10201 jobs"):
        grid_jobs(parse(*args), [])


@pytest.mark.parametrize(("args", "keys", "fragment"), [
    (("lr=1,2", "batch_size=4,8,16"), ["lr", "batch_size"], "lr: 2, batch_size: 3"),
    (("lr=1,2", "batch_size=4"), ["lr", "batch_size"], "names batch_size, which this sweep does not vary"),
    (("lr=1,2",), ["lr", "seed"], "names seed"),
])
def test_a_zip_that_cannot_pair_names_the_keys(args: tuple[str, ...], keys: list[str], fragment: str) -> None:
    with pytest.raises(UserError, match=r"sweep\.zip") as err:
        grid_jobs(parse(*args), keys)
    assert fragment in str(err.value)


def test_lr_scales_with_batch_size_from_the_smallest_or_a_given_base() -> None:
    jobs = grid_jobs(parse("lr=1e-3", "batch_size=4,16"), [])
    assert [j[-1] for j in scale_lr(jobs, "sqrt", None, None)] == ["lr=0.001", "lr=0.002"]
    assert [j[-1] for j in scale_lr(jobs, "linear", 8, None)] == ["lr=0.0005", "lr=0.002"]
    unswept = grid_jobs(parse("batch_size=4,16"), [])
    assert [j[-1] for j in scale_lr(unswept, "linear", None, 3e-4)] == ["lr=0.0003", "lr=0.0012"]  # the config's lr
    assert scale_lr(jobs, "none", None, None) == jobs
    with pytest.raises(UserError, match="lr=auto cannot be scaled"):
        scale_lr(unswept, "sqrt", None, "auto")
    with pytest.raises(UserError, match=r"e\.g\. batch_size=4,8,16$"):  # a batch size's example, not an lr's
        scale_lr(grid_jobs(parse("lr=1e-3", "batch_size=4,big"), []), "sqrt", None, None)
    with pytest.raises(UserError, match="does not vary"):
        scale_lr(grid_jobs(parse("lr=1e-3,2e-3"), []), "sqrt", None, None)


def test_the_lr_a_grid_scales_is_the_one_the_run_would_take(tmp_path: Path) -> None:
    """With lr=auto, a from-scratch run on the stdlib data takes data.pretrain_lr (6e-4), so a grid scales that;
    a fine-tune takes lr=auto's rule, which no grid can scale before the model is loaded."""
    assert lr_to_scale(compose([], tmp_path / "a")) == 6e-4
    assert lr_to_scale(compose(["lr=1e-3"], tmp_path / "b")) == 1e-3
    assert lr_to_scale(compose([f"model.name_or_path={tmp_path}"], tmp_path / "c")) == "auto"


def test_an_interval_in_a_grid_asks_for_a_search() -> None:
    with pytest.raises(UserError, match="sweep=random or sweep=tpe"):
        grid_jobs(parse("lr=interval(1e-5,1e-2)"), [])


# ----------------------------------------------------------------------------- search space


def test_search_space_reads_hydra_optuna_syntax() -> None:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    space, fixed = search_space(parse("lr=tag(log,interval(1e-5,1e-1))", "batch_size=choice(4,8)",
                                      "train.warmup_steps=tag(int,interval(0,20))", "model.r=range(1,4)", "seed=3"))
    assert space["lr"] == FloatDistribution(1e-5, 1e-1, log=True)
    assert space["batch_size"] == CategoricalDistribution([4, 8])
    assert space["train.warmup_steps"] == IntDistribution(0, 20)
    assert space["model.r"] == CategoricalDistribution([1, 2, 3])
    assert fixed == ["seed=3"]
    assert probe_job(parse("lr=tag(log,interval(1e-5,1e-1))", "batch_size=choice(4,8)", "seed=3")) == [
        "lr=1e-05", "batch_size=4", "seed=3"]
    with pytest.raises(UserError, match="at least one swept key"):
        search_space(parse("seed=3"))
    with pytest.raises(UserError, match="start > 0"):
        search_space(parse("lr=tag(log,interval(0.0,1.0))"))


def test_a_categorical_space_is_a_grid_and_a_trial_keeps_the_command_lines_order() -> None:
    """What Hydra's sweeper suites need of a search (tests/test_hydra_conformance.py), as pure functions."""
    overrides = parse("batch_size=choice(4,8)", "seed=3", "model.r=range(1,3)")
    space, _ = search_space(overrides)
    assert finite_grid(space, 4) == [{"batch_size": 4, "model.r": 1}, {"batch_size": 4, "model.r": 2},
                                     {"batch_size": 8, "model.r": 1}, {"batch_size": 8, "model.r": 2}]
    assert finite_grid(space, 3) is None  # more points than trials: the sampler picks
    assert finite_grid(search_space(parse("batch_size=4,8", "lr=interval(1e-4,1e-3)"))[0], 100) is None
    huge, _ = search_space(parse(*(f"+k{i}=range(0,100)" for i in range(10))))
    assert finite_grid(huge, 12) is None  # 1e20 points, counted and not listed
    assert trial_overrides({"batch_size": 8, "model.r": 1}, overrides) == ["batch_size=8", "seed=3", "model.r=1"]


def test_another_apps_trial_is_worth_what_its_task_returns() -> None:
    from hydra.core.utils import JobReturn, JobStatus

    def ret(value: Any, status: JobStatus = JobStatus.COMPLETED) -> JobReturn:
        job = JobReturn(status=status)
        job.return_value = value
        return job

    assert returned_result(ret(3)) == TrialResult("completed", value=3.0)
    for value in (float("nan"), None, "0.5", True):
        assert returned_result(ret(value)).status == "crashed", value
    assert returned_result(ret(ValueError("bad x"), JobStatus.FAILED)) == TrialResult("crashed",
                                                                                     reason="ValueError: bad x")


# ----------------------------------------------------------------------------- how a trial ended


def _run_dir(path: Path, summary: dict | None, job_status: dict | None = None) -> Path:
    """A run directory as the trainer and launcher leave it (the files only: `read_result` reads nothing else)."""
    path.mkdir(parents=True)
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    if job_status is not None:
        (path / "job_status.json").write_text(json.dumps(job_status))
    return path


def test_read_result_classifies_each_way_a_trial_ends(tmp_path: Path) -> None:
    error = {"kind": "non_finite", "severity": "error", "message": "loss is nan at step 7", "advice": "lower the lr",
             "step": 7}
    cases = {
        "done": ({"status": "completed", "eval_loss": 3.5, "step": 20, "findings": []}, None),
        "pruned": ({"status": "pruned", "eval_loss": 5.0, "step": 9, "findings": []}, {"status": "pruned"}),
        "diverged": ({"status": "diverged", "eval_loss": None, "step": 7, "findings": [error]}, {"status": "diverged"}),
        "preempted": ({"status": "preempted", "step": 4, "findings": []}, {"status": "preempted"}),
        "killed": (None, {"status": "killed", "error": "the job process was killed by SIGKILL"}),
        "never": (None, None),
    }
    got = {name: read_result(_run_dir(tmp_path / name, *files)) for name, files in cases.items()}
    assert got["done"] == TrialResult("completed", value=3.5, step=20)
    assert got["pruned"] == TrialResult("pruned", step=9)
    assert got["diverged"] == TrialResult("failed", step=7, reason="non_finite: loss is nan at step 7")
    assert got["preempted"].status == got["never"].status == "running"  # resumed by a rerun
    assert got["killed"] == TrialResult("crashed", reason="the job process was killed by SIGKILL")


def test_a_failed_trial_teaches_the_sampler_and_a_crash_does_not() -> None:
    """optuna's TPE reads COMPLETE and PRUNED trials only: a doctor's failure is told as PRUNED (status failed)."""
    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    space = {"lr": FloatDistribution(1e-5, 1e-1, log=True)}
    failed, crashed, done = (study.ask(space) for _ in range(3))
    failed.report(9.0, 5)
    tell(study, failed, TrialResult("failed", step=7, reason="divergence: loss rose 10x"))
    tell(study, crashed, TrialResult("crashed", reason="killed"))
    tell(study, done, TrialResult("completed", value=3.0, step=20))
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.PRUNED, TrialState.FAIL, TrialState.COMPLETE]
    assert trials[0].user_attrs == {"status": "failed", "stopped_step": 7, "reason": "divergence: loss rose 10x"}
    seen = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))  # what TPE learns from
    assert [t.number for t in seen] == [0, 2]
    assert study.best_trial.number == 2


# ----------------------------------------------------------------------------- end to end, through the CLI


def test_sweep_mistakes_exit_2_and_name_the_key(tmp_path: Path) -> None:
    unpaired = run_cli(["--multirun", "lr=1e-3,2e-3", "batch_size=4,8,16", "sweep.zip=[lr,batch_size]",
                        f"hydra.sweep.dir={tmp_path / 's'}"], cwd=tmp_path)
    assert unpaired.returncode == 2 and "sweep.zip" in unpaired.stderr and "lr: 2, batch_size: 3" in unpaired.stderr
    assert "Traceback" not in unpaired.stderr and not (tmp_path / "s").exists()
    grid_pruner = run_cli(["sweep.pruner=asha", "train.max_steps=1"], cwd=tmp_path)
    assert grid_pruner.returncode == 2 and "sweep.pruner: a pruner stops the trials of a search" in grid_pruner.stderr

RUN = [*TINY, "precision=fp32", "train.max_steps=12", "train.eval_steps=4", "train.save_steps=4",
       "train.warmup_steps=1"]
ENV = {"OMP_NUM_THREADS": "1"}
LONG = [o for o in RUN if not o.startswith("train.max_steps=")] + ["train.max_steps=100"]
"""Long enough that a Ctrl-C after the first checkpoint finds the job still running, on any machine."""


def _start(args: list[str], sweep_dir: Path, log_name: str, run: list[str] = RUN) -> subprocess.Popen:
    with open(sweep_dir.parent / log_name, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "llmexp", "--multirun", *run, *args,
                                 f"hydra.sweep.dir={sweep_dir}"], cwd=sweep_dir.parent, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **ENV}, preexec_fn=_default_sigint)


def _default_sigint() -> None:
    """pytest-xdist's workers ignore SIGINT, and a child inherits that: give the sweep Ctrl-C's usual meaning."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for(ready: Callable[[], bool], what: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"the sweep ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _has_checkpoint(run_dir: Path) -> Callable[[], bool]:
    return lambda: any((run_dir / "checkpoints").glob("step_*"))


def _study(sweep_dir: Path) -> Any:
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(study_journal(sweep_dir))))
    return optuna.load_study(study_name=STUDY_NAME, storage=storage)


@pytest.mark.slow
def test_search_prunes_and_survives_a_kill_9_of_the_sweeper(tmp_path: Path) -> None:
    """Random search, seed 0: lr 1.6e-3 and 7.3e-3; the sweeper is SIGKILLed while trial 1 runs, and the
    same command finishes the search without running trial 0 or 1 again, its sampler seeded 0 + 2 (the
    trials it found) so as not to repeat them: lr 5.6e-4, then 1.3e-5, which the median pruner stops
    after its first eval."""
    from optuna.trial import TrialState

    sweep = tmp_path / "search"
    args = ["sweep=random", "sweep.seed=0", "sweep.n_trials=4", "sweep.pruner=median",
            "lr=tag(log,interval(1e-5,1e-1))"]
    first = _start(args, sweep, "first.log")
    _wait_for(_has_checkpoint(sweep / "1"), "trial 1's first checkpoint", first)  # trial 0 ended, 1 half-way
    first.send_signal(signal.SIGKILL)
    first.wait()
    second = run_cli(["--multirun", *RUN, *args, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=ENV)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Resuming 1 interrupted trials" in second.stdout + second.stderr

    trials = _study(sweep).get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3]
    assert trials[0].state == trials[1].state == TrialState.COMPLETE
    for trial in trials[:2]:  # each ran once: its orphaned process finished trial 1, and its result was kept
        run_dir = sweep / str(trial.number)
        assert len(read_metrics(run_dir, "start")) == 1
        assert math.isclose(trial.value, json.loads((run_dir / "summary.json").read_text())["eval_loss"])
    assert math.isclose(trials[3].params["lr"], 1.3e-5, rel_tol=0.05)
    assert trials[3].state == TrialState.PRUNED and trials[3].user_attrs["status"] == "pruned"
    pruned = json.loads((sweep / "3" / "summary.json").read_text())
    assert pruned["status"] == "pruned" and pruned["step"] in (4, 8)  # at an eval, where the pruner decided
    assert trials[3].user_attrs["stopped_step"] == pruned["step"] == max(trials[3].intermediate_values)
    assert (sweep / "3" / "checkpoints" / f"step_{pruned['step']}").is_dir()  # stopped as a preemption stops
    assert read_metrics(sweep / "3", "pruned")[0]["reason"].startswith("pruned by the sweeper's MedianPruner")
    assert (sweep / "sweep_report.md").exists()


@pytest.mark.slow
def test_a_grid_run_again_skips_ended_jobs_and_resumes_interrupted_ones(tmp_path: Path) -> None:
    sweep = tmp_path / "grid"
    args = ["lr=1e-3,3e-3"]
    first = _start(args, sweep, "first.log", LONG)
    _wait_for(_has_checkpoint(sweep / "1"), "job 1's first checkpoint", first)
    first.send_signal(signal.SIGINT)  # Ctrl-C: the launcher asks job 1 to checkpoint and stop
    assert first.wait(timeout=300) == 1
    assert json.loads((sweep / "1" / "summary.json").read_text())["status"] == "preempted"

    again = run_cli(["--multirun", *LONG, *args, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=ENV)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "1 of 2 jobs already ended" in again.stdout + again.stderr
    assert len(read_metrics(sweep / "0", "start")) == 1  # not run again
    assert read_metrics(sweep / "1", "resume")  # resumed from its checkpoint
    assert json.loads((sweep / "1" / "summary.json").read_text())["status"] == "completed"

    other = run_cli(["--multirun", *LONG, "lr=5e-3,3e-3", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=ENV)
    assert other.returncode == 2
    assert f"{sweep / '0'} holds a job of another sweep" in other.stderr
