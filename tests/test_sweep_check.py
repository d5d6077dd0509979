"""A sweep is checked whole before it launches (`llmexp.sweep.check`), its directory is locked, its study
journal verified, and its exit code says the same thing for a grid and a search.

Refusals run the real CLI in this process (`cli_refusal`: Hydra's run and multirun replaced, so a command
that slips through raises instead of training); a few run it in a subprocess, and two sweeps train.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmexp.errors import UserError
from llmexp.rundir.read import TrialResult, sweep_exit_code
from llmexp.rundir.study import check_journal, study_journal
from tests.conftest import TINY, Launched, run_cli

SEARCH = ["--multirun", "sweep=tpe", "lr=tag(log,interval(1e-5,1e-2))"]
GRID = ["--multirun", "lr=1e-3,2e-3"]

# (id, args, fragments that must all appear in stderr: the key, then the rule or the fix)
SWEEP_MISTAKES: list[tuple[str, list[str], list[str]]] = [
    ("n_trials_zero", [*SEARCH, "sweep.n_trials=0"], ["sweep.n_trials: must be >= 1, got 0"]),
    ("n_trials_beyond_64_bits", [*SEARCH, "sweep.n_trials=99999999999999999999"], ["sweep.n_trials", "64 bits"]),
    ("parallel_zero", [*SEARCH, "sweep.parallel=0"], ["sweep.parallel: must be >= 1"]),
    ("seed_negative", [*SEARCH, "sweep.seed=-1"], ["sweep.seed: must be in [0, 2**64 - 1]"]),
    ("pruner_unknown", [*SEARCH, "sweep.pruner=asah"], ["sweep.pruner: 'asah' is not one of none, asha"]),
    ("lr_scaling_unknown", ["--multirun", "lr=1e-3", "batch_size=4,8", "sweep.lr_scaling=cube"],
     ["sweep.lr_scaling: 'cube' is not one of none, sqrt, linear"]),
    ("sampler_unknown", [*SEARCH, "hydra.sweeper.sampler=cmaes"], ["hydra.sweeper.sampler: 'cmaes' is not one of"]),
    ("hydra_sweeper_n_trials", [*SEARCH, "hydra.sweeper.n_trials=-3"], ["hydra.sweeper.n_trials: must be >= 1"]),
    ("hydra_launcher_max_parallel", [*GRID, "hydra.launcher.max_parallel=0"],
     ["hydra.launcher.max_parallel: must be >= 1"]),
    ("cluster_max_parallel", [*GRID, "cluster.max_parallel=0"], ["cluster.max_parallel: must be >= 1"]),
    ("interval_reversed", ["--multirun", "sweep=tpe", "lr=interval(1e-2,1e-5)"],
     ["lr=interval(0.01, 1e-05)", "its start must be below its end"]),
    ("interval_empty", ["--multirun", "sweep=tpe", "lr=interval(1e-3,1e-3)"],
     ["lr=interval(0.001, 0.001): its start and end are equal", "lr=interval(0.001, 0.01)", "or set lr=0.001"]),
    ("int_interval_empty", ["--multirun", "sweep=tpe", "train.warmup_steps=tag(int,interval(4,4))"],
     ["train.warmup_steps=interval(4, 40)", "or set train.warmup_steps=4 "]),
    ("range_empty", ["--multirun", "batch_size=range(4,2)"], ["batch_size: this sweep holds no value"]),
    ("range_empty_in_a_search", ["--multirun", "sweep=tpe", "lr=range(4,2)"], ["lr: this sweep holds no value"]),
    ("interval_end_out_of_range", ["--multirun", "sweep=tpe", "train.warmup_ratio=interval(0.0,1.5)"],
     ["train.warmup_ratio=1.5", "train.warmup_ratio: must be in [0, 1)"]),
    ("interval_not_finite", ["--multirun", "sweep=tpe", "lr=interval(1e-5,inf)"], ["lr", "finite"]),
    ("tag_unknown", ["--multirun", "sweep=tpe", "lr=tag(lg,interval(1e-5,1e-2))"],
     ["lr: unknown tag 'lg'", "log, int"]),
    ("tag_on_a_choice", ["--multirun", "sweep=tpe", "lr=tag(log,choice(1e-3,1e-2))"],
     ["lr: tag(log, ...) applies to an interval"]),
    ("int_interval_of_fractions", ["--multirun", "sweep=tpe", "batch_size=tag(int,interval(0.5,8.5))"],
     ["batch_size: tag(int, interval(0.5, 8.5)) needs integer bounds"]),
    ("choice_value_out_of_range", ["--multirun", "sweep=tpe", "batch_size=choice(4,0)"],
     ["batch_size=0", "batch_size: must be >= 1"]),
    ("grid_value_out_of_range", ["--multirun", "lr=1e-3,-1"], ["lr=-1", "lr: must be > 0"]),
    ("grid_too_large", ["--multirun", "seed=range(0,100000000)"], ["100000000 jobs", "at most"]),
    ("choice_too_large", ["--multirun", "sweep=tpe", "seed=range(0,100000000)"], ["seed", "100000000 values"]),
    # sweep.metric: one that every job records, the same for every job, in its better direction
    ("metric_not_recorded", [*GRID, "sweep.metric=tasks/demo/acc", "sweep.direction=maximize"],
     ["sweep.metric=tasks/demo/acc: no job records it", "eval=demo sweep.metric=tasks/demo/acc"]),
    ("metric_not_recorded_by_one_job", ["--multirun", "eval=demo,loss", "sweep.metric=tasks/demo/acc",
                                        "sweep.direction=maximize"],
     ["job #1 (eval=loss):", "sweep.metric=tasks/demo/acc: no job records it"]),
    ("metric_at_a_search_edge", ["--multirun", "sweep=tpe", "eval=choice(demo,loss)", "sweep.metric=tasks/demo/acc",
                                 "sweep.direction=maximize"], ["search value eval=loss", "no job records it"]),
    ("metric_swept", ["--multirun", "eval=demo", "sweep.metric=tasks/demo/acc,tasks/demo/acc_norm",
                      "sweep.direction=maximize"],
     ["sweep.metric: the jobs rank by different metrics (tasks/demo/acc (maximize), tasks/demo/acc_norm (maximize))"]),
    ("direction_against_the_metric", [*SEARCH, "eval=demo", "sweep.metric=tasks/demo/acc"],
     ["sweep.direction=minimize: tasks/demo/acc is better higher; set sweep.direction=maximize"]),
    ("direction_unknown", [*GRID, "sweep.direction=up"], ["sweep.direction: 'up' is not one of minimize, maximize"]),
    # hydra.sweep.subdir: a directory of each job's own (they ran in one, their metrics and checkpoints mixed)
    ("subdir_shared", [*GRID, "hydra.sweep.subdir=same"],
     ["hydra.sweep.subdir: job #1 (lr=0.002) would run in ", "/sweep/same, as job #0 (lr=0.001) does"]),
    ("subdir_the_sweep_dir", [*GRID, "hydra.sweep.subdir=."], ["job #0 (lr=0.001) would run in", "as the sweep"]),
    ("subdir_shared_by_trials", [*SEARCH, "hydra.sweep.subdir=trial"], ["trial #1 would run in", "as trial #0 does"]),
    ("subdir_of_a_trials_values", [*SEARCH, "hydra.sweep.subdir=${hydra.job.num}_${hydra.job.override_dirname}"],
     ["hydra.sweep.subdir: a search names each trial's directory by its number"]),
]


@pytest.mark.parametrize(("args", "fragments"), [c[1:] for c in SWEEP_MISTAKES], ids=[c[0] for c in SWEEP_MISTAKES])
def test_a_sweep_mistake_is_refused_before_the_sweep_launches(args: list[str], fragments: list[str],
                                                              cli_refusal, tmp_path: Path) -> None:
    code, err = cli_refusal([*args, f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert code == 2, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    assert not (tmp_path / "sweep").exists()


def test_a_sweep_whose_every_job_can_run_is_not_refused(cli_refusal, tmp_path: Path) -> None:
    """Only the configs a sweep runs are judged: here no config but the jobs' names a training file."""
    from tests.conftest import Launched

    files = [tmp_path / f"{name}.jsonl" for name in ("a", "b")]
    for f in files:
        f.write_text('{"text": "hello"}\n' * 10)
    with pytest.raises(Launched):
        cli_refusal(["--multirun", "data=json", f"data.train_file={files[0]},{files[1]}",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}"])


def test_a_search_space_given_in_the_config_is_checked_too(cli_refusal, tmp_path: Path) -> None:
    """`hydra.sweeper.params` (a space in a YAML file, as Hydra's Optuna sweeper takes it) is read by the sweep
    alone (`schema.SweeperSettings.params`: sweep_only), and checked as the command line's space is."""
    experiment = tmp_path / "conf" / "experiment"
    experiment.mkdir(parents=True)
    (experiment / "space.yaml").write_text("# @package _global_\nhydra:\n  sweeper:\n    params:\n"
                                           "      lr: interval(1,0)\n")
    code, err = cli_refusal(["--multirun", "--config-dir", str(tmp_path / "conf"), "sweep=tpe", "experiment=space",
                             f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert code == 2 and "lr=interval(1.0, 0.0): its start must be below its end" in err, err
    assert not (tmp_path / "sweep").exists()


def test_an_empty_search_exits_2_in_a_real_process(tmp_path: Path) -> None:
    """It used to run a study of no trials and exit 0."""
    proc = run_cli([*SEARCH, "sweep.n_trials=0", f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path,
                   timeout_s=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "sweep.n_trials: must be >= 1" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "sweep").exists()


# ----------------------------------------------------------------------------- the study journal


def _journal(tmp_path: Path) -> Path:
    """A sweep directory whose journal holds a real study with one trial."""
    import optuna
    from optuna.distributions import FloatDistribution

    from llmexp.rundir.study import STUDY_NAME, journal_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=journal_storage(tmp_path), study_name=STUDY_NAME)
    trial = study.ask({"lr": FloatDistribution(1e-5, 1e-2, log=True)})
    study.tell(trial, 3.0)
    return study_journal(tmp_path)


@pytest.mark.parametrize(("damage", "fragment"), [
    (lambda b: b[: len(b) - 7], "its last line is cut short"),  # truncated mid-line
    (lambda b: b[: len(b) // 2] + b"\n" + b[len(b) // 2:], "is not JSON"),  # torn in the middle
    (lambda b: b"PK\x03\x04 not a journal at all\n", "line 1 is not JSON"),
    (lambda b: b'{"hello": "world"}\n', "line 1 is not an optuna journal entry"),
    (lambda b: b'{"op_code": 4, "worker_id": "x"}\n', "optuna cannot replay it"),  # a trial of no study
])
def test_a_damaged_journal_is_one_message(damage, fragment: str, tmp_path: Path) -> None:
    path = _journal(tmp_path)
    check_journal(tmp_path)  # the real one passes
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(UserError) as err:
        check_journal(tmp_path)
    text = str(err.value)
    assert fragment in text and "study.journal is damaged" in text and "hydra.sweep.dir" in text, text


def test_a_search_on_a_damaged_journal_exits_2_and_writes_nothing(cli_refusal, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    path = _journal(sweep)
    path.write_bytes(path.read_bytes()[:-5])
    before = sorted(p.name for p in sweep.iterdir())
    code, err = cli_refusal([*SEARCH, f"hydra.sweep.dir={sweep}"])
    assert code == 2 and "study.journal is damaged" in err and "Traceback" not in err, err
    assert sorted(p.name for p in sweep.iterdir()) == before


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind", ["grid", "search"])
def test_a_sweep_into_another_sweeps_directory_exits_2_and_writes_nothing(kind: str, cli_refusal,
                                                                          tmp_path: Path) -> None:
    """Refused before Hydra writes multirun.yaml, the launcher its pickles or the search its study."""
    sweep = tmp_path / "sweep"
    for num, lr in enumerate(["0.005", "0.006"]):  # an earlier grid's two jobs, as Hydra records them
        (sweep / str(num) / ".hydra").mkdir(parents=True)
        (sweep / str(num) / ".hydra" / "overrides.yaml").write_text(f"- lr={lr}\n")
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    before = _files(sweep)
    code, err = cli_refusal([*(SEARCH if kind == "search" else GRID), f"hydra.sweep.dir={sweep}"])
    assert code == 2 and "Traceback" not in err, err
    assert f"{sweep / '0'} holds a job of another sweep (lr=0.005)" in err and "new hydra.sweep.dir" in err, err
    assert _files(sweep) == before


def test_a_grid_run_again_in_its_own_directory_is_not_refused(cli_refusal, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    (sweep / "0" / ".hydra").mkdir(parents=True)
    (sweep / "0" / ".hydra" / "overrides.yaml").write_text("- lr=0.001\n")  # GRID's job #0, from an earlier launch
    with pytest.raises(Launched):
        cli_refusal([*GRID, f"hydra.sweep.dir={sweep}"])


def test_a_rerun_may_reorder_its_overrides_and_change_where_its_jobs_run(tmp_path: Path) -> None:
    """A rerun with a longer cluster.timeout_min after a time limit, or its overrides in another order, was refused
    as "another sweep", so such a sweep could not be continued."""
    from llmexp.sweep.jobs import launched_before

    job = tmp_path / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- seed=1\n- cluster.timeout_min=1\n- lr=0.001\n")
    assert launched_before(job, 0, ["lr=0.001", "cluster=slurm", "cluster.timeout_min=5", "seed=1",
                                    "sweep.metric=eval_ppl", "hydra.launcher.max_parallel=2"])
    with pytest.raises(UserError, match="holds a job of another sweep"):
        launched_before(job, 0, ["lr=0.001", "seed=2"])


# ----------------------------------------------------------------------------- the sweep directory's lock


def _hold_sweep_lock(sweep: Path) -> subprocess.Popen:
    """Another process holding the sweep directory as a running sweeper does."""
    code = ("import sys, time; from llmexp.rundir.lock import lock_sweep_dir; lock_sweep_dir(sys.argv[1]); "
            "print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(sweep)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.parametrize("kind", ["grid", "search"])
def test_a_second_sweeper_on_a_sweep_directory_in_use_is_refused(kind: str, cli_refusal, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    holder = _hold_sweep_lock(sweep)
    try:
        code, err = cli_refusal([*(SEARCH if kind == "search" else GRID), f"hydra.sweep.dir={sweep}"])
    finally:
        holder.kill()
        holder.wait()
    assert code == 2, err
    assert f"{sweep} is in use by another llmexp sweep (pid {holder.pid})" in err and "hydra.sweep.dir=" in err
    assert sorted(p.name for p in sweep.iterdir()) == [".llmexp.lock"]


def test_the_sweep_lock_ends_with_its_holder(tmp_path: Path) -> None:
    """An flock, as the run directory's: a sweeper killed with SIGKILL does not block the rerun."""
    from llmexp.rundir.lock import lock_sweep_dir

    holder = _hold_sweep_lock(tmp_path)
    holder.kill()
    holder.wait()
    lock_sweep_dir(tmp_path)  # no error: the kernel dropped the dead holder's lock


# ----------------------------------------------------------------------------- one exit code for grid and search


def _result(status: str) -> TrialResult:
    if status == "mistake":  # exited 2, as `read_result` reads a job that stopped on a user's mistake
        return TrialResult("crashed", user_error=True)
    return TrialResult(status, value=3.0 if status == "completed" else None)


@pytest.mark.parametrize(("statuses", "code"), [
    (["completed", "completed"], 0),
    (["completed", "failed"], 0),  # a diverged lr is a result of an lr sweep
    (["completed", "pruned", "failed"], 0),
    (["pruned", "pruned"], 0),  # the pruner decided; nothing diverged
    (["failed"], 3),  # every job diverged: the sweep found nothing that trains
    (["failed", "pruned"], 3),
    (["completed", "crashed"], 1),  # a job that did not end by itself: run the command again
    (["failed", "running"], 1),
    (["completed", "mistake"], 1),  # one job's own mistake
    (["mistake", "mistake"], 2),  # a mistake every job hit: the same command would repeat it
    ([], 1),
])
def test_the_sweep_exit_code(statuses: list[str], code: int) -> None:
    assert sweep_exit_code([_result(s) for s in statuses]) == code


DIVERGE = [*TINY, "precision=fp32", "train.max_steps=3", "train.eval_steps=3", "train.save_steps=0",
           "train.warmup_steps=0", "train.on_anomaly=stop", "train.peak_tflops=1", "scheduler=constant"]


@pytest.mark.slow
def test_a_grid_and_a_search_agree_on_diverged_jobs(tmp_path: Path) -> None:
    """A grid with one diverged lr exits 0 (it used to exit 1); a search whose every trial diverges exits 3,
    as a grid whose every job diverges does (it used to exit 0). The report names what diverged."""
    grid = run_cli(["--multirun", *DIVERGE, "lr=1e-3,1e4", "cluster.max_parallel=2",
                    f"hydra.sweep.dir={tmp_path / 'grid'}"], cwd=tmp_path)
    assert grid.returncode == 0, grid.stderr[-3000:]
    jobs = json.loads((tmp_path / "grid" / "sweep_summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["completed", "diverged"]
    started = time.monotonic()
    search = run_cli(["--multirun", *DIVERGE, "sweep=random", "sweep.n_trials=1", "lr=interval(1e4,1e5)",
                      f"hydra.sweep.dir={tmp_path / 'search'}"], cwd=tmp_path)
    assert search.returncode == 3, search.stderr[-3000:]
    assert "every trial diverged" in search.stdout + search.stderr, search.stdout[-3000:]
    assert time.monotonic() - started < 300


@pytest.mark.slow
def test_a_grid_whose_job_directories_name_their_values_reads_each_job_there(tmp_path: Path) -> None:
    """hydra.sweep.subdir=seed${seed}: each job runs in its own named directory and the sweep's verdict reads it
    there: every job diverged, exit 3 (the sweeper read job N back from directory N: an InterpolationKeyError
    traceback after the jobs had run, and with ${hydra.job.override_dirname} a verdict from directories that
    do not exist)."""
    sweep = tmp_path / "sweep"
    proc = run_cli(["--multirun", *DIVERGE, "lr=1e4", "seed=0,1", "hydra.sweep.subdir=seed${seed}",
                    f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["seed0", "seed1"]
    assert [j["status"] for j in json.loads((sweep / "sweep_summary.json").read_text())["jobs"]] == ["diverged"] * 2
