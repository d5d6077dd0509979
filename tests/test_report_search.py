"""The sweep report of a search (sweep=random|tpe): the optuna study's history, pruned trials, importances.

The report is a pure function of files: the study's journal and the job directories. So these tests build a
real optuna study by hand (ask/tell with real distributions, real intermediate values, pruned, failed and
still-running trials, in the JournalStorage file the sweeper uses) and write the job directories' files
themselves, as a sweep that ran that way would have left them; no training runs here.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from llmexp.report.__main__ import main as report_main
from llmexp.report.search import load_study
from llmexp.report.sweep import write_sweep_report
from llmexp.rundir.study import STUDY_NAME, study_journal
from tests.test_monitor import history
from tests.test_report import make_run, png_size, summary_of

MAX_STEPS = 100
SPACE = {"lr": FloatDistribution(1e-5, 1e-1, log=True), "batch_size": CategoricalDistribution([2, 4])}

# trial: (lr, batch_size, state, final eval loss the curve falls to, the step it stopped at)
TRIALS: list[tuple[float, int, TrialState, float, int]] = [
    (1e-3, 4, TrialState.COMPLETE, 2.5, MAX_STEPS),
    (3e-3, 2, TrialState.COMPLETE, 2.2, MAX_STEPS),
    (1e-5, 4, TrialState.PRUNED, 1.0, 40),  # its loss when stopped is the lowest of all: still never recommended
    (5e-4, 2, TrialState.COMPLETE, 2.4, MAX_STEPS),
    (9e-2, 4, TrialState.FAIL, 2.0, 20),
    (2e-5, 2, TrialState.PRUNED, 2.9, 20),
    (2e-3, 4, TrialState.RUNNING, 2.3, 60),  # live: metrics so far, no summary.json yet
]


def new_study(sweep: Path) -> optuna.Study:
    journal = study_journal(sweep)
    journal.parent.mkdir(parents=True, exist_ok=True)
    storage = JournalStorage(JournalFileBackend(str(journal)))
    return optuna.create_study(study_name=STUDY_NAME, storage=storage, direction="minimize")


def write_multirun_yaml(sweep: Path, n_trials: int) -> None:
    config = {"sweep": {"name": "tpe", "pruner": "asha", "n_trials": n_trials, "seed": 0, "parallel": 1},
              "train": {"max_steps": MAX_STEPS}, "hydra": {"mode": "MULTIRUN"}}
    (sweep / "multirun.yaml").write_text(yaml.safe_dump(config))


def add_trial(study: optuna.Study, sweep: Path, params: dict[str, Any], state: TrialState, final: float,
              stop: int) -> None:
    """One trial told to the study as the sweeper would, and its job directory as the run left it."""
    records = history(num_steps=stop, eval_steps=20, seed=len(study.trials),
                      loss=lambda s: final + 3 * math.exp(-s / 30),
                      eval_loss=lambda s: final + 0.1 + 3 * math.exp(-s / 30))
    study.enqueue_trial(params)  # the next trial gets these values (through the distributions below)
    trial = study.ask(SPACE)
    evals = [r for r in records if r["event"] == "eval"]
    for r in evals:
        trial.report(r["eval_loss"], r["step"])
    overrides = [f"lr={params['lr']}", f"batch_size={params['batch_size']}", f"train.max_steps={MAX_STEPS}"]
    trial.set_user_attr("overrides", overrides)
    summary: dict[str, Any] | None = summary_of(records)
    if state == TrialState.PRUNED:
        summary = {**summary_of(records, status="pruned"), "step": stop}
        trial.set_user_attr("stopped_step", stop)
    elif state == TrialState.FAIL:  # a doctor's error: the sweeper tells it as PRUNED, its status says failed
        summary = summary_of(records, status="diverged")
        trial.set_user_attr("reason", "doctor: non_finite at step 20")
        trial.set_user_attr("stopped_step", stop)
        state = TrialState.PRUNED
    elif state == TrialState.RUNNING:
        summary = None
    if summary is not None:
        trial.set_user_attr("status", "failed" if summary["status"] == "diverged" else summary["status"])
    make_run(sweep / str(trial.number), records, summary, tuple(overrides))
    if state == TrialState.COMPLETE:
        study.tell(trial, evals[-1]["eval_loss"])
    elif state != TrialState.RUNNING:
        study.tell(trial, state=state)


def make_search(sweep: Path) -> optuna.Study:
    sweep.mkdir(parents=True)
    write_multirun_yaml(sweep, n_trials=8)
    study = new_study(sweep)
    for lr, batch_size, state, final, stop in TRIALS:
        add_trial(study, sweep, {"lr": lr, "batch_size": batch_size}, state, final, stop)
    return study


def test_search_report_has_history_pruned_trials_importances_and_figure(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    study = make_search(sweep)
    summary = write_sweep_report(sweep)
    search = summary["search"]
    # optuna gives a pruned trial its last intermediate value as its value: the report shows it as a latest
    # eval loss, not as the objective's value
    values = [t.value if t.state == TrialState.COMPLETE else None for t in study.trials]
    assert search["counts"] == {"complete": 3, "pruned": 2, "fail": 1, "running": 1, "stopped": 0}
    assert search["steps_spent"] == 3 * MAX_STEPS + 40 + 20 + 20 + 60 and search["steps_budget"] == 8 * MAX_STEPS
    assert search["best_trial"] == 1
    assert [r["best_so_far"] for r in search["trials"]] == [values[0]] + [values[1]] * 6
    assert [r["value"] for r in search["trials"]] == values
    assert [r["stopped_step"] for r in search["trials"] if r["state"] == "pruned"] == [40, 20]
    assert set(search["importances"]) == {"lr", "batch_size"}
    assert sum(search["importances"].values()) == pytest.approx(1.0, abs=0.01)

    jobs = {j["job"]: j for j in json.loads((sweep / "sweep_summary.json").read_text())["jobs"]}
    assert jobs["2"]["status"] == "pruned" and jobs["5"]["status"] == "pruned"  # pruned, not failed
    assert jobs["6"]["status"] == "running" and jobs["6"]["error"] is None and jobs["6"]["step"] == 60
    assert jobs["6"]["eval_loss"] is not None  # a running job shows its latest metrics
    assert summary["recommendation"]["job"] == "1"  # the best complete trial; pruned job 2's lower loss is not

    text = (sweep / "sweep_report.md").read_text()
    assert "**Recommended:** `lr=0.003 batch_size=2` (job 1)" in text
    assert "## Search: tpe, pruner asha" in text
    assert "3 complete, 2 pruned, 1 failed, 1 running" in text
    assert "**training steps spent:** 440 of 800 (n_trials × train.max_steps 100) = 55%" in text
    assert "`lr` log-uniform [1e-05, 0.1]" in text and "`batch_size` one of [2, 4]" in text
    assert "| 2 | 1e-05 | 4 | pruned at step 40 |" in text
    assert "| 4 | 0.09 | 4 | fail (doctor: non_finite at step 20) | (" in text
    assert "### Pruned trials" in text and "| 5 | `lr=2e-05 batch_size=2` | 20 |" in text
    assert "| `lr` |" in text and "| `batch_size` |" in text  # the importances table
    assert "![search history](sweep_search.png)" in text
    # interrupted: the trial stays RUNNING in the study, its run says preempted (the report said "running")
    (sweep / "6" / "summary.json").write_text(json.dumps({"status": "preempted", "step": 60}))
    summary = write_sweep_report(sweep)
    assert summary["search"]["counts"]["running"] == 0 and summary["search"]["counts"]["stopped"] == 1
    assert "1 failed, 0 running, 1 stopped" in (sweep / "sweep_report.md").read_text()
    assert "| stopped (preempted) |" in (sweep / "sweep_report.md").read_text()
    width, height = png_size(sweep / "sweep_search.png")
    assert width / height > 2.8  # history, trial curves and the lr landscape
    assert report_main([str(sweep)]) == 1  # a trial still runs: the sweep is not finished


def test_report_mid_sweep_reads_a_journal_being_written(tmp_path: Path) -> None:
    """The sweeper appends to the journal while the report reads it: a torn last line (a write in
    progress) is skipped, and the report is written from the whole lines before it."""
    sweep = tmp_path / "sweep"
    make_search(sweep)
    with open(study_journal(sweep), "a") as f:
        f.write('{"op_code": 4, "worker_id": "x", "trial_id": 7, "para')
    study, error = load_study(sweep)
    assert error is None and study is not None
    assert len(study.trials) == len(TRIALS) and study.trials[-1].state == TrialState.RUNNING
    study_journal(sweep).write_text("not a journal\n")  # a damaged journal: said in one line, the rest reported
    summary = write_sweep_report(sweep)
    assert summary["search"] is None and "could not be read" in summary["search_error"]
    assert "**Search:** the optuna study" in (sweep / "sweep_report.md").read_text()


def test_importances_that_cannot_be_computed_are_explained_in_one_line(tmp_path: Path) -> None:
    """One complete trial and one pruned, with only lr searched: no importances, one line saying why; a search
    whose trials all completed or were pruned has finished (exit 0)."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    write_multirun_yaml(sweep, n_trials=2)
    study = new_study(sweep)
    for lr, state, final, stop in ((1e-3, TrialState.COMPLETE, 2.5, MAX_STEPS), (1e-5, TrialState.PRUNED, 3.0, 20)):
        add_trial(study, sweep, {"lr": lr, "batch_size": 4}, state, final, stop)
    summary = write_sweep_report(sweep)
    assert summary["search"]["importances"] is None
    assert "not computed: 1 complete trial(s); it takes at least 2" in (sweep / "sweep_report.md").read_text()
    assert summary["all_finished"] is True and report_main([str(sweep)]) == 0


def test_a_grid_sweep_has_no_search_section(tmp_path: Path) -> None:
    for job, lr in enumerate(("1e-4", "3e-4")):
        records = history(num_steps=100, seed=job)
        make_run(tmp_path / str(job), records, summary_of(records), (f"lr={lr}",))
    summary = write_sweep_report(tmp_path)
    assert summary["search"] is None and summary["recommendation"] is not None
    assert "## Search" not in (tmp_path / "sweep_report.md").read_text()
    assert not (tmp_path / "sweep_search.png").exists()


def test_a_search_whose_trials_have_no_loss_yet_draws_without_a_warning(tmp_path: Path) -> None:
    """A search's first trial just started (no eval loss): sweep_search.png is drawn without matplotlib's "No
    artists with labels found to put in legend" warning, which reached the sweep's console."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    write_multirun_yaml(sweep, n_trials=2)
    new_study(sweep).ask(SPACE).set_user_attr("overrides", ["lr=0.001", "batch_size=2"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_sweep_report(sweep)
    assert (sweep / "sweep_search.png").stat().st_size > 10_000
