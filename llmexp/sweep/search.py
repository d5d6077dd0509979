"""`sweep=random|tpe`: an optuna search whose trials are sweep jobs, pruned from their live evals
(`llmexp.train.pruning`, in each trial's own process). It asks `sweep.parallel` trials, launches them as one
batch, and tells each how its run ended, until `sweep.n_trials` have ended. How the same command continues it, and
why a small categorical space runs as its grid: docs/how-to/sweeps.md ("Search", Resumable). For another app, a
trial's result is its task's return value and nothing prunes.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from optuna.distributions import distribution_to_json
from optuna.trial import TrialState

from llmexp.config.schema import SearchSweepConfig
from llmexp.errors import EXIT_ERROR, UserError
from llmexp.rundir.read import TrialResult, read_result
from llmexp.rundir.study import STUDY_NAME, journal_storage, make_pruner, study_journal
from llmexp.sweep.jobs import StopRequest, exit_for_results, job_dir_of, launched_before, objective, write_report
from llmexp.sweep.space import finite_grid, search_space, trial_overrides
from llmexp.sweep.tracking import close_parent

log = logging.getLogger(__name__)


def make_sampler(name: str, seed: int, n_trials: int) -> optuna.samplers.BaseSampler:
    """TPE starts from random points: a quarter of the budget (2 to 10), since optuna's default of 10 would
    leave a 12-trial search almost random; `constant_liar` keeps parallel trials apart."""
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, min(10, n_trials // 4)), constant_liar=True)


def open_study(sweep_dir: Path, space: dict[str, Any], fixed: Sequence[str], sampler: Any, pruner: Any,
               metric: str, direction: str) -> Any:
    """The sweep directory's study, created or loaded; a directory holding another search is refused."""
    study = optuna.create_study(storage=journal_storage(sweep_dir), study_name=STUDY_NAME, sampler=sampler,
                                pruner=pruner, direction=direction, load_if_exists=True)
    settings = [o for o in fixed if o.split("=")[0].split(".")[0] in ("sweep", "hydra")]  # may change on a rerun
    identity = {"space": {k: distribution_to_json(d) for k, d in space.items()},
                "fixed": [o for o in fixed if o not in settings], "metric": metric, "direction": direction}
    stored = study.user_attrs.get("search")
    if stored is None:
        study.set_user_attr("search", identity)
        study.set_user_attr("metric", metric)
    elif stored != identity:
        raise UserError(f"{sweep_dir} holds another search (space {stored['space']}, overrides {stored['fixed']}, "
                        f"sweep.metric={stored.get('metric', 'eval_loss')} {stored.get('direction', 'minimize')}d); "
                        "rerun that command to continue it, or pick a new hydra.sweep.dir for this one")
    return study


def returned_result(ret: JobReturn) -> TrialResult:
    """Another app's trial: its task's return value is the value to minimize, as Hydra's Optuna sweeper reads it."""
    if ret.status != JobStatus.COMPLETED:
        error = ret._return_value  # the exception; the public `return_value` would raise it
        return TrialResult("crashed", reason=f"{type(error).__name__}: {error}")
    value = ret.return_value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return TrialResult("crashed", reason=f"the task returned {value!r}, not a finite number to minimize")
    return TrialResult("completed", value=float(value))


def tell(study: Any, trial: optuna.Trial, result: TrialResult) -> None:
    """Record an ended trial in the study. optuna's samplers learn nothing from FAIL trials (TPE reads COMPLETE and
    PRUNED ones only), so a trial that failed on a doctor's error is told as PRUNED at its last eval, which ranks it
    below every completed trial: the sampler learns the region is bad. Its `status` attribute says `failed` and its
    `reason` the finding; only a crash (a bug, a killed process) is optuna's FAIL."""
    trial.set_user_attr("status", result.status)
    if result.step is not None:
        trial.set_user_attr("stopped_step" if result.status != "completed" else "step", result.step)
    if result.reason:
        trial.set_user_attr("reason", result.reason)
    if result.status == "completed":
        study.tell(trial, result.value)
    else:
        study.tell(trial, state=TrialState.PRUNED if result.status in ("pruned", "failed") else TrialState.FAIL)


def _pruner(config: Any, search: SearchSweepConfig, llmexp_app: bool) -> Any:
    """`sweep.pruner` for llmexp's trials (they report their evals); another app's trials report nothing."""
    if llmexp_app:
        return make_pruner(search.pruner, int(config.train.eval_steps), int(config.train.max_steps))
    if search.pruner != "none":
        raise UserError(f"hydra.sweeper.pruner={search.pruner}: trials report their evals from llmexp's trainer, "
                        "which this app does not run; use hydra.sweeper.pruner=none")
    return optuna.pruners.NopPruner()


def run_search(sweeper: Any, overrides: Sequence[Any], sampler_name: str, search: SearchSweepConfig
               ) -> list[Sequence[JobReturn]]:
    """The search sweeper's `sweep` (its settings: `hydra.sweeper.*`, mapped from `sweep.*`; `sampler_name`: random
    or tpe): resume the interrupted trials, then ask, launch and tell until done, or until Ctrl-C, wherever it lands:
    the launcher stops the running trials, and an optuna write ends whole first."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    config = sweeper.config
    space, fixed = search_space(overrides)
    sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
    metric, direction = objective(config)
    sampler = make_sampler(sampler_name, search.seed, search.n_trials)
    if not study_journal(sweep_dir).exists():  # a new search: before its study is created, no other sweep's job
        launched_before(job_dir_of(config, 0), 0, None)
    with StopRequest():  # optuna's writes end whole
        study = open_study(sweep_dir, space, fixed, sampler, _pruner(config, search, metric is not None),
                           metric or "returned", direction)
        n_trials, grid = search.n_trials, finite_grid(space, search.n_trials)
        if grid is not None:
            log.info(f"The search space has {len(grid)} points, no more than the {n_trials} trials asked for: "
                     "each runs once, in the grid's order")
            n_trials = len(grid)
            if not study.trials:  # a rerun finds them queued (WAITING) or run in the study
                for params in grid:
                    study.enqueue_trial(params)
    if study.trials:  # a rerun: a sampler seeded as the first run's would propose that run's points again
        study.sampler = make_sampler(sampler_name, search.seed + len(study.trials), search.n_trials)
    returns: list[Sequence[JobReturn]] = []
    resumed = [optuna.trial.Trial(study, frozen._trial_id)  # the storage's id: optuna has no public lookup
               for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
    if resumed:
        log.info(f"Resuming {len(resumed)} interrupted trials of {sweep_dir}: "
                 f"{', '.join(str(t.number) for t in resumed)}")
    try:
        going = all(_run_batch(sweeper, study, batch, sweep_dir, returns, metric) for batch in _contiguous(resumed))
        while going and (ended := _ended(study)) < n_trials:
            with StopRequest():  # optuna's writes end whole
                batch = [study.ask(space) for _ in range(min(search.parallel, n_trials - ended))]
                for trial in batch:
                    trial.set_user_attr("overrides", trial_overrides(trial.params, overrides))
            going = _run_batch(sweeper, study, batch, sweep_dir, returns, metric)
    except KeyboardInterrupt:
        log.warning(f"interrupted; run the same command with hydra.sweep.dir={sweep_dir} to continue the search "
                    "(interrupted trials resume from their checkpoints)")
    if metric is not None:
        write_report(sweep_dir)
        close_parent(sweep_dir, ok=_ended(study) >= n_trials)  # logger=mlflow: the sweep's parent run
    _log_best(study, sweep_dir, metric)
    if metric is not None:  # grid and search agree: jobs.sweep_exit_code; a trial not yet started has not ended
        results = [read_result(job_dir_of(config, t.number), metric) for t in study.trials]
        exit_for_results(results + [TrialResult("running")] * (n_trials - len(results)), "trial", sweep_dir)
    elif _ended(study) < n_trials:  # another app's search, interrupted
        raise SystemExit(EXIT_ERROR)
    return returns


def _ended(study: Any) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)))


def _contiguous(trials: Sequence[optuna.Trial]) -> list[list[optuna.Trial]]:
    """Runs of consecutive trial numbers: a launch numbers its jobs from one index on."""
    ordered = enumerate(sorted(trials, key=lambda t: t.number))  # in a run, number - position is the same
    return [[t for _, t in run] for _, run in itertools.groupby(ordered, key=lambda it: it[1].number - it[0])]


def _run_batch(sweeper: Any, study: Any, batch: list[optuna.Trial], sweep_dir: Path,
               returns: list[Sequence[JobReturn]], metric: str | None) -> bool:
    """Launch one batch of trials (each prunes itself), tell how each ended (its `metric` at the end; None: another
    app's trial, its returned value); False if the sweep was interrupted."""
    jobs = [list(t.user_attrs["overrides"]) for t in batch]
    sweeper.validate_batch_is_legal(jobs)
    job_dirs = {t.number: job_dir_of(sweeper.config, t.number) for t in batch}
    for trial in batch:
        log.info(f"  trial {trial.number}: {' '.join(f'{k}={v}' for k, v in trial.params.items())}")
    stopped = interrupted = False
    try:
        returns.append(sweeper.launcher.launch(jobs, initial_job_idx=batch[0].number))  # each trial prunes itself
    except KeyboardInterrupt:  # the launcher stopped the trials still running: tell those that ended, then stop
        if metric is None:  # another app's trials: their results were the launch's returns
            raise
        stopped = True
    for i, trial in enumerate(batch):
        result = read_result(job_dirs[trial.number], metric) if metric is not None else returned_result(returns[-1][i])
        if result.status == "running":
            interrupted = True  # stays RUNNING: a rerun resumes it from its checkpoint
            continue
        with StopRequest():
            tell(study, trial, result)
        if result.user_error:
            raise UserError(f"trial {trial.number} stopped on a mistake that every trial would repeat, so the search "
                            f"stops: {result.reason}")
        shown = f"{result.value:.4f}" if result.value is not None else result.reason or f"step {result.step}"
        log.info(f"  trial {trial.number} {result.status}: {shown}")
    if stopped:
        raise KeyboardInterrupt
    if interrupted:
        log.warning(f"the search was interrupted; run the same command with hydra.sweep.dir={sweep_dir} to "
                    "continue it (interrupted trials resume from their checkpoints)")
    return not interrupted


def _log_best(study: Any, sweep_dir: Path, metric: str | None) -> None:
    where, value = (sweep_dir / "sweep_report.md", metric) if metric is not None else (sweep_dir, "returned")
    try:
        best = study.best_trial
    except ValueError:
        log.warning(f"no trial completed; see {where}")
        return
    log.info(f"Best trial {best.number}: {value} {best.value:.4f} with {json.dumps(best.params)}; see {where}")
