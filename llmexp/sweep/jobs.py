"""Sweep jobs, whatever runs them (`llmexp.sweep.local`: a process per job; `llmexp.sweep.slurm`: a job array).

llmexp's own jobs (`is_llmexp_config`) run through `execute` (security check, run-directory lock, outcome from
`summary.json`) and the sweep ends with `finish_sweep` (`job_status.json`, the report, exit 1 if a job did not
finish); another app's run through `run_task` as Hydra's basic launcher runs them. No torch or submitit here.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict

from llmexp.config.origin import origin_of
from llmexp.config.security import check_config
from llmexp.errors import EXIT_ERROR, EXIT_USER, STATUS_EXIT, UserError
from llmexp.rundir.files import write_json_atomic, write_text_atomic
from llmexp.rundir.lock import lock_run_dir, wait_for_lock
from llmexp.rundir.read import (
    FINISHED,
    TrialResult,
    load_job_status,
    load_overrides,
    load_summary,
    shown_overrides,
    sweep_exit_code,
    swept_keys,
    varying_keys,
)
from llmexp.rundir.redact import print_user_error, scrub_overrides
from llmexp.sweep.tracking import close_parent, open_parent

T = TypeVar("T")

log = logging.getLogger(__name__)

_launched = False


def jobs_launched() -> bool:
    """True once this process launched sweep jobs (the CLI then knows an exit 1 is not a compose error)."""
    return _launched


@dataclass
class JobSpec:
    """One sweep job, composed in the launching process."""

    num: int
    overrides: list[str]
    config: Any
    """The job's composed DictConfig (Hydra node included), sweep directory already resolved."""
    job_dir: Path


@dataclass
class JobOutcome:
    """How a job ended, as the launcher saw it."""

    num: int
    status: str
    """completed, early_stopped, diverged, failed, cancelled, killed, timeout, preempted, submitted..."""
    exit_code: int | None = None
    error: str | None = None
    job_id: str | None = None
    """The SLURM job id (array form), when there is one."""


def is_llmexp_config(config: Any) -> bool:
    """The composed config is llmexp's trainer config (it has `cluster` and `train` nodes), so the
    launchers add llmexp's extras: resume on requeue, `job_status.json`, the sweep report."""
    return all(isinstance(config.get(key, None), DictConfig) for key in ("cluster", "train"))


def objective(config: Any) -> tuple[str | None, str]:
    """What a sweep ranks its jobs by: (`sweep.metric`, `sweep.direction`) of llmexp's config; (None, minimize)
    for another app, whose trials return the value to minimize."""
    return (str(config.sweep.metric), str(config.sweep.direction)) if is_llmexp_config(config) else (None, "minimize")


def exit_2_on_user_error(action: Callable[..., T], *args: Any) -> T:
    """`action(*args)`, a user's mistake inside a launcher or sweeper (Hydra would print it as a traceback and
    exit 1) printed as one line, secrets scrubbed, and exit 2, as the CLI prints its own."""
    try:
        return action(*args)
    except UserError as err:
        raise SystemExit(print_user_error("llmexp", err)) from None


def compose_jobs(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int,
                 compose: bool = True) -> list[JobSpec]:
    """Every job's spec, its config composed now unless `compose=False`. `hydra.sweep.dir` is resolved once here: its
    `${llmexp_run_id:}` must not be re-evaluated in a child process or on a SLURM node, where time and pid differ.
    Composition takes ~0.3 s a job (Hydra's sweeper has already composed each once), so the SLURM launcher leaves it to
    the node, unless the job's directory depends on its values (`subdir_names_values`)."""
    global _launched
    _launched = True
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir)).absolute()
    with open_dict(launcher.config):
        launcher.config.hydra.sweep.dir = str(sweep_dir)
    compose = compose or subdir_names_values(launcher.config)
    open_parent(launcher.config, sweep_dir)  # logger=mlflow: the jobs' runs nest under it
    specs = []
    for num, overrides in enumerate(job_overrides, start=initial_job_idx):
        cfg = compose_job(launcher, list(overrides), num) if compose else None
        specs.append(JobSpec(num=num, overrides=list(overrides), config=cfg,
                             job_dir=job_dir_of(cfg if cfg is not None else launcher.config, num)))
    return specs


def subdir_names_values(config: Any) -> bool:
    """`hydra.sweep.subdir` interpolates more than the job's number (`${hydra.job.override_dirname}`, `${lr}`): only a
    job's own composed config knows its directory."""
    subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")  # type: ignore[union-attr]
    return "${" in str(subdir).replace("${hydra.job.num}", "")


def job_dir_of(config: Any, num: int) -> Path:
    """Job `num`'s run directory: `hydra.sweep.dir` / `hydra.sweep.subdir` evaluated for that job."""
    probe = config  # a job's composed config knows its number; the sweep's is given it on a copy
    if OmegaConf.select(config, "hydra.job.num", default=None) != num:
        probe = OmegaConf.create({"hydra": OmegaConf.to_container(config.hydra)})
        OmegaConf.update(probe, "hydra.job.num", num)
    return Path(str(config.hydra.sweep.dir)).absolute() / str(OmegaConf.select(probe, "hydra.sweep.subdir"))


def compose_job(launcher: Any, overrides: list[str], num: int) -> Any:
    """One job's config, as Hydra's basic launcher composes it; llmexp's own jobs then pass the CLI's security
    check (`security.check_config`, each problem named with its file) before anything runs or is written."""
    loader = launcher.hydra_context.config_loader
    cfg = loader.load_sweep_config(launcher.config, overrides)
    with open_dict(cfg):
        cfg.hydra.job.id = str(num)
        cfg.hydra.job.num = num
    if is_llmexp_config(cfg):  # another app's config is that app's to judge
        composed_from = [*OmegaConf.to_container(launcher.config.hydra.overrides.hydra), *overrides]  # type: ignore[misc]
        check_config(cfg, origin=origin_of(loader, cfg, composed_from))
    return cfg


def run_status(job_dir: Path) -> str | None:
    status = (load_summary(job_dir) or {}).get("status")
    return str(status) if status else None


def _enter(singleton_state: Any) -> None:
    """The launching process's Hydra state (config store, resolvers) in this process, as Hydra's launchers do."""
    Singleton.set_state(singleton_state)
    setup_globals()


def _run_job(spec: JobSpec, task_function: Any, hydra_context: Any) -> JobReturn:
    return run_job(hydra_context=hydra_context, task_function=task_function, config=spec.config,
                   job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")


def run_task(spec: JobSpec, task_function: Any, hydra_context: Any, singleton_state: Any) -> JobReturn:
    """Any Hydra app's job, in this process, as Hydra's basic launcher runs it; never raises for a failing task."""
    _enter(singleton_state)
    return _run_job(spec, task_function, hydra_context)


def failed_return(spec: JobSpec, message: str) -> JobReturn:
    """The JobReturn of a job that left none (killed, lost): FAILED, its value the error Hydra re-raises."""
    return JobReturn(overrides=spec.overrides, cfg=spec.config, working_dir=str(spec.job_dir), status=JobStatus.FAILED,
                     _return_value=RuntimeError(message))


def execute(spec: JobSpec, task_function: Any, hydra_context: Any, singleton_state: Any) -> JobOutcome:
    """Run one of llmexp's jobs in this process through Hydra's `run_job`; never raises for a failing task. The
    security check and the job directory's lock come first, before Hydra writes there; a refusal is this job's."""
    from llmexp.train.guarded import last_user_error, user_error_exit

    _enter(singleton_state)
    try:
        check_config(spec.config)
    except UserError as err:
        return JobOutcome(spec.num, "failed", user_error_exit(err), last_user_error())
    try:
        lock_run_dir(spec.job_dir)
    except UserError as err:  # busy, not a mistake: the same command runs the job once its holder has ended
        user_error_exit(err)
        return JobOutcome(spec.num, "failed", EXIT_ERROR, last_user_error())
    ret = _run_job(spec, task_function, hydra_context)
    if ret.status == JobStatus.COMPLETED:
        value = ret._return_value
        code = value if isinstance(value, int) and not isinstance(value, bool) else 0
        status = run_status(spec.job_dir) or ("completed" if code == 0 else "failed")
        user_error = last_user_error() if code == EXIT_USER else None  # a user error's own message, when it was one
        return JobOutcome(spec.num, status, code, (user_error or f"the task exited with code {code}") if code else None)
    err = ret._return_value
    traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    return JobOutcome(spec.num, "failed", 1, f"{type(err).__name__}: {err}")


ENDED = (*FINISHED, "diverged", "pruned")
"""Statuses of a job that a rerun of its sweep does not run again: it reached an end of its own. Any other
(preempted, cancelled, killed, timeout, failed, or no summary) runs again and resumes from its checkpoint."""


def launched_before(job_dir: Path, num: int, overrides: Sequence[str] | None) -> bool:
    """Whether `job_dir` holds an earlier launch of job #`num` (these `overrides`; None: a new search's trial, not
    asked yet). A directory that holds a job with other overrides belongs to another sweep: UserError, raised by the
    CLI before Hydra writes anything in the sweep directory, and by the launcher again before it writes."""
    recorded = load_overrides(job_dir)
    if not recorded:
        return False
    if overrides is not None and _what_it_trains(recorded) == _what_it_trains(scrub_overrides(overrides)):
        return True
    mine = f"this sweep's job #{num} ({' '.join(overrides)})" if overrides is not None else "a new search's trial"
    raise UserError(f"{job_dir} holds a job of another sweep ({' '.join(recorded)}), not {mine}; rerun that "
                    "sweep's command, or pick a new hydra.sweep.dir")


NOT_THE_JOB = ("cluster", "hydra.launcher.", "sweep.metric=", "sweep.direction=")
"""Overrides a rerun may change without making its jobs others: where they run (a longer cluster.timeout_min after
a time limit, cluster=slurm for a local sweep) and how the report ranks them."""


def _what_it_trains(overrides: Sequence[str]) -> list[str]:
    """A job's overrides in any order, without `NOT_THE_JOB`'s."""
    return sorted(o for o in overrides if not o.lstrip("+~").startswith(NOT_THE_JOB))


def ended_before(spec: JobSpec) -> JobOutcome | None:
    """The outcome of a job that this sweep directory already holds, ended (`ENDED`), or None. A job still running
    from an earlier launch (whose launcher was killed) holds its run directory's lock and is waited for first."""
    if not launched_before(spec.job_dir, spec.num, spec.overrides):
        return None  # no earlier launch of this job (a lock held by anything else fails the job, as always)
    wait_for_lock(spec.job_dir, lambda pid: log.info(f"  {spec.job_dir} is still running from an earlier launch "
                                                     f"(pid {pid}); waiting for it to end"))
    status = run_status(spec.job_dir)
    verdict = load_job_status(spec.job_dir).get("status", status)
    return JobOutcome(spec.num, status, STATUS_EXIT[status], None) if status in ENDED and verdict == status else None


def split_ended(specs: Sequence[JobSpec]) -> tuple[list[JobSpec], dict[int, JobOutcome]]:
    """(the jobs to run, the outcomes of those that ended in an earlier launch of this sweep)."""
    ended = {spec.num: outcome for spec in specs if (outcome := ended_before(spec)) is not None}
    if ended:
        log.info(f"{len(ended)} of {len(specs)} jobs already ended in {specs[0].job_dir.parent}; not run again: "
                 f"{', '.join(f'#{n}' for n in sorted(ended))}")
    return [spec for spec in specs if spec.num not in ended], ended


def record_outcome(spec: JobSpec, outcome: JobOutcome) -> None:
    """Leave `job_status.json`, the launcher's verdict (a summary may say `preempted` for a job SLURM then cancelled),
    in the job dir of every job that did not complete or left no summary.json; remove a stale one from a job that
    ended well. Its `overrides` (and `.hydra/overrides.yaml`, as Hydra writes it) name a job that never started."""
    status_path = spec.job_dir / "job_status.json"
    if outcome.status in FINISHED and outcome.exit_code in (0, None) and (spec.job_dir / "summary.json").exists():
        status_path.unlink(missing_ok=True)
        return
    write_json_atomic(status_path, {**asdict(outcome), "overrides": spec.overrides})
    overrides_yaml = spec.job_dir / ".hydra" / "overrides.yaml"
    if not overrides_yaml.exists():  # what Hydra would have written, so reports show the job's settings
        write_text_atomic(overrides_yaml, yaml.safe_dump(spec.overrides))


def write_report(sweep_dir: Path) -> None:
    """The sweep report (llmexp.report.sweep); a failing report must not hide the jobs' outcomes."""
    try:
        from llmexp.report.sweep import write_sweep_report

        write_sweep_report(sweep_dir)
    except Exception as err:  # report bugs must not turn a finished sweep into a crash
        log.warning(f"writing the sweep report failed: {type(err).__name__}: {err}")
    else:
        log.info(f"Sweep report: {sweep_dir / 'sweep_report.md'}")


def job_returns(specs: Sequence[JobSpec], outcomes: Sequence[JobOutcome]) -> list[JobReturn]:
    """One COMPLETED JobReturn per job, its value the job's exit code: failures are reported by `finish_sweep`, not by
    raising the first job's exception from Hydra's sweeper, which would hide the others."""
    return [JobReturn(overrides=spec.overrides, working_dir=str(spec.job_dir), status=JobStatus.COMPLETED,
                      task_name=str(spec.config.hydra.job.name) if spec.config is not None else None,
                      _return_value=outcome.exit_code) for spec, outcome in zip(specs, outcomes, strict=True)]


def swept(job: Sequence[str], jobs: Sequence[Sequence[str]], keys: Sequence[str] = ()) -> str:
    """The overrides of `job` of the swept `keys` (`rundir.read.swept_keys`) and those that differ between `jobs`
    (`lr=0.001 batch_size=4`), or all of them when none do: as the status and the sweep report show a job."""
    return shown_overrides(job, varying_keys(jobs, keys))


def finish_sweep(specs: Sequence[JobSpec], outcomes: Sequence[JobOutcome], within_search: bool) -> list[JobReturn]:
    """Record every outcome, write the sweep report, print a summary; exit 2 if every job stopped on a user's
    mistake, else 1 if a job did not end by itself (`ENDED`: a diverged job did, and is a result), unless the batch
    belongs to a search (`within_search`), which reads each trial's end itself. Whether every job diverged (exit
    3) is the sweeper's to say, once every batch has run (`sweep_exit_code`)."""
    for spec, outcome in zip(specs, outcomes, strict=True):
        record_outcome(spec, outcome)
    sweep_dir = specs[0].job_dir.parent
    write_report(sweep_dir)
    if within_search:  # a search ends its own parent run, logs its trials and reads how each ended
        return job_returns(specs, outcomes)
    close_parent(sweep_dir, ok=all(o.status in FINISHED for o in outcomes))  # logger=mlflow: the sweep's parent run
    jobs, keys = [s.overrides for s in specs], swept_keys(sweep_dir)
    for spec, outcome in zip(specs, outcomes, strict=True):
        detail = f": {outcome.error}" if outcome.error and outcome.status not in FINISHED else ""
        log.info(f"  #{spec.num} {outcome.status:<13} {swept(spec.overrides, jobs, keys)}{detail}")
    if outcomes and all(o.exit_code == EXIT_USER for o in outcomes):  # the same command would only repeat it
        log.error(f"every job stopped on a mistake in its config or data (exit 2): {outcomes[0].error}; fix it and "
                  "run the sweep again")
        raise SystemExit(EXIT_USER)
    if bad := [o for o in outcomes if o.status not in ENDED]:
        log.error(f"{len(bad)} of {len(outcomes)} jobs did not end by themselves; see {sweep_dir} (the same "
                  "command runs them again)")
        raise SystemExit(1)
    return job_returns(specs, outcomes)


def exit_for_results(results: Sequence[TrialResult], what: str, sweep_dir: Path) -> None:
    """End the sweep with `sweep_exit_code(results)` (raise SystemExit) unless it is 0, saying why."""
    code = sweep_exit_code(results)
    if code == 3:
        log.error(f"every {what} diverged or failed a doctor's check, so the sweep found no setting that trains "
                  f"(exit 3); see {sweep_dir / 'sweep_report.md'}")
    elif code:
        log.error(f"{sum(r.status in ('crashed', 'running') for r in results)} of {len(results)} {what}s have not "
                  f"ended (stopped, crashed or not started; exit 1); run the same command to continue; see "
                  f"{sweep_dir / 'sweep_report.md'}")
    if code:
        raise SystemExit(code)


class StopRequest:
    """While active, SIGINT (Ctrl-C) and SIGTERM are counted in `count`, not raised, so that the block acts on them
    where it is safe (an optuna write ends whole), and raised as KeyboardInterrupt as the block ends. Inert outside
    the main thread, and for a signal this process ignores (a script's background job ignores SIGINT)."""

    def __enter__(self) -> StopRequest:
        self.count, self._previous = 0, dict[int, Any]()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._count)
        return self

    def _count(self, *_: object) -> None:
        self.count += 1

    def __exit__(self, error: type[BaseException] | None, *_: object) -> None:
        for sig, previous in self._previous.items():  # None: not installed from Python; the default is the guess
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        if self.count and error is None:
            raise KeyboardInterrupt
