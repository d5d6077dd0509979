"""`hydra/launcher=llmexp_slurm` (llmexp's `cluster=slurm`): a sweep as one SLURM job array through submitit
(`SlurmJob` composes each job's config on its node), and the job that runs there. With `cluster.wait=true` the
launcher polls `sacct` and records every job however it ended, instead of raising at the first failure.

Signals: submitit installs SIGUSR2 -> checkpoint-and-requeue; while the run lasts, llmexp's `PreemptionSignal`
replaces it (and SIGTERM) with a flag, so the trainer checkpoints at the next step boundary and returns `preempted`.
`SlurmJob` then requeues through submitit's handler only if SLURM still runs the job, so a `scancel` is never
undone; once the outcome is final SIGUSR2 is ignored (`job_over`). Only rank 0 of a multi-task job writes
`.hydra/` and decides about requeueing. See docs/tutorials/slurm-and-preemption.md and docs/how-to/sweeps.md.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import submitit
from hydra.core.singleton import Singleton
from omegaconf import DictConfig, OmegaConf, open_dict

from llmexp.config.tree import register_resolvers
from llmexp.errors import UserError, first_line
from llmexp.process import settle_for_exit, tune_collector
from llmexp.rundir.files import write_json_atomic
from llmexp.rundir.lock import LOCK_NAME
from llmexp.rundir.read import read_slurm_jobs, slurm_end_status
from llmexp.sweep.jobs import (
    JobOutcome,
    JobSpec,
    compose_job,
    compose_jobs,
    execute,
    failed_return,
    finish_sweep,
    is_llmexp_config,
    job_returns,
    record_outcome,
    run_task,
    split_ended,
    swept,
)

log = logging.getLogger(__name__)


def sbatch_parameters(cluster: DictConfig, job_name: str) -> dict[str, Any]:
    """submitit's SlurmExecutor parameters from the launcher's settings (`hydra.launcher.*`)."""
    params: dict[str, Any] = {
        "job_name": job_name, "time": int(cluster.timeout_min), "nodes": int(cluster.nodes),
        "ntasks_per_node": int(cluster.tasks_per_node), "cpus_per_task": int(cluster.cpus_per_task),
        "signal_delay_s": int(cluster.signal_delay_s), "array_parallelism": int(cluster.array_parallelism),
    }
    optional = {  # each only where it is set
        "gpus_per_node": cluster.gpus_per_node and int(cluster.gpus_per_node),
        "mem": cluster.mem_gb and f"{int(cluster.mem_gb)}GB",
        **{key: cluster[key] and str(cluster[key]) for key in ("partition", "account", "qos", "constraint")},
        "additional_parameters": OmegaConf.to_container(cluster.additional_parameters, resolve=True),
        "setup": cluster.setup and [str(line) for line in cluster.setup],
    }
    return {**params, **{key: value for key, value in optional.items() if value}}


class SlurmJob(submitit.helpers.Checkpointable):
    """One sweep job on a SLURM node: runs the task, and requeues it when the trainer was preempted."""

    def __init__(self, spec: JobSpec, launcher: Any, singleton_state: Any, extras: bool = True) -> None:
        self.spec = spec
        self.launcher = launcher
        """Hydra's launcher: the sweep's config, config loader and task function."""
        self.singleton_state = singleton_state
        self.extras = extras
        """llmexp's task (`is_llmexp_config`): an outcome dict, resume on requeue; else Hydra's JobReturn."""

    def __call__(self) -> Any:
        tune_collector()  # submitit's process, before the job imports torch
        requeue_handler = signal.getsignal(signal.SIGUSR2)  # submitit's, installed before this call
        env = submitit.JobEnvironment()
        if self.spec.config is None:  # composed here, not at submission (see compose_jobs)
            Singleton.set_state(self.singleton_state)
            register_resolvers()
            self.spec = replace(self.spec, config=compose_job(self.launcher, self.spec.overrides, self.spec.num))
        spec = self.spec
        if env.num_tasks > 1:
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
            if env.global_rank != 0:  # one writer for .hydra/
                spec = replace(spec, config=_with(spec.config, "hydra.output_subdir", None))
        if not self.extras:
            result = run_task(spec, self.launcher.task_function, self.launcher.hydra_context, self.singleton_state)
            job_over()
            return result
        outcome = execute(spec, self.launcher.task_function, self.launcher.hydra_context, self.singleton_state)
        outcome.job_id = env.job_id
        if env.global_rank == 0 and outcome.status == "preempted":
            outcome = _requeue_or_stop(outcome, requeue_handler)
        if env.global_rank == 0:  # for `cluster.wait=false`: nobody else may be watching
            record_outcome(spec, outcome)
        job_over()
        return asdict(outcome)

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """The same job again, resuming from the newest checkpoint in its run directory."""
        spec = self.spec
        if spec.config is not None and self.extras:  # None: signalled before composing, so nothing ran yet
            spec = replace(spec, config=_with(spec.config, "train.resume", "auto"))
        again = SlurmJob(spec, self.launcher, self.singleton_state, self.extras)
        return submitit.helpers.DelayedSubmission(again, *args, **kwargs)


def _with(cfg: DictConfig, key: str, value: Any) -> DictConfig:
    cfg = cfg.copy()
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def slurm_state(job_id: str, accounting: bool = False) -> str:
    """The job's state as squeue reports it now (RUNNING, COMPLETING, CANCELLED...), or with `accounting` as sacct
    records it (`CANCELLED by 1000`: squeue shows a cancelled job tidying up as COMPLETING); '' if unknown."""
    command = ["sacct", "-n", "-P", "-X", "-o", "State", "-j", job_id] if accounting else \
        ["squeue", "-h", "-j", job_id, "-o", "%T"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return first_line(out, None)


def job_over() -> None:
    """The job's outcome is final and submitit's process ends once it has saved it: the process is settled for its
    exit (`llmexp.process`), and SIGUSR2 (the time-limit warning) ignored until then. It can change nothing any
    more, and it could do harm: submitit's handler would requeue a finished job, and once Python has restored the
    default action on its way out (it does for every signal it handled, not for an ignored one), the warning kills
    the process, so SLURM records a completed job FAILED (seen: the last attempt of a requeued job finished a few
    seconds before its warning)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    settle_for_exit()


def _requeue_or_stop(outcome: JobOutcome, requeue_handler: Any) -> JobOutcome:
    """After the trainer saved and returned `preempted`: requeue if SLURM still runs the job."""
    state = slurm_state(str(outcome.job_id))
    if state == "COMPLETING":  # ending: how (a scancel while no launcher watched was recorded `preempted`)
        state = slurm_state(str(outcome.job_id), accounting=True) or state
    if state != "RUNNING" or not callable(requeue_handler):
        outcome.error = f"stopped by a signal; SLURM state {state or 'unknown'}, so not requeued here"
        if state.startswith("CANCELLED"):
            outcome.status = "cancelled"
        return outcome
    log.warning(f"job {outcome.job_id}: checkpoint saved after a signal; requeueing it")
    # The requeue makes slurmctld SIGTERM every process of this job, submitit's `scontrol requeue` too,
    # which can die of it before it exits 0: submitit then takes the done requeue for a failure and this
    # attempt would record `preempted` while the job runs again. An ignored signal stays ignored across
    # exec (a Python handler such as submitit's is reset), so scontrol is started with SIGTERM ignored;
    # this process ignores it meanwhile, as submitit's own handler does. Only the main thread may.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
    try:
        requeue_handler(signal.SIGUSR2, None)  # submitit: checkpoint() -> scontrol requeue -> exit
    except submitit.core.utils.UncompletedJobError as err:  # no requeues left (cluster.max_num_timeout)
        return JobOutcome(outcome.num, "timeout", outcome.exit_code, str(err), outcome.job_id)
    except subprocess.CalledProcessError as err:
        return JobOutcome(outcome.num, "preempted", outcome.exit_code, f"requeue failed: {err}", outcome.job_id)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    return outcome  # not reached when the requeue succeeded: submitit exits the process


def launch_slurm(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list:
    """Hydra's `launch` for `hydra/launcher=llmexp_slurm`: submit every job as one array, then wait or return."""
    settings, extras = launcher.settings, is_llmexp_config(launcher.config)
    if shutil.which("sbatch") is None:
        raise UserError("cluster=slurm needs SLURM's sbatch on PATH; run on a SLURM login node, or start a "
                        "one-machine cluster with `sudo bash launch/slurm-local.sh up`, or use cluster=local")
    all_specs = compose_jobs(launcher, job_overrides, initial_job_idx, compose=False)
    specs, ended = split_ended(all_specs) if extras else (all_specs, {})
    sweep_dir = all_specs[0].job_dir.parent
    if not specs:  # a rerun of a sweep whose jobs all ended: nothing to submit
        return finish_sweep(all_specs, [ended[s.num] for s in all_specs], launcher.within_search)
    folder = Path(str(settings.submitit_folder or sweep_dir / ".submitit" / "%j")).absolute()
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=int(settings.max_num_timeout))
    executor.update_parameters(**sbatch_parameters(settings, str(launcher.config.hydra.job.name)))
    state, fresh = Singleton.get_state(), [s.job_dir for s in specs if not s.job_dir.exists()]
    for spec in specs if extras else ():  # until the job records how it ended, the report shows it as submitted
        record_outcome(spec, JobOutcome(spec.num, "submitted", None, "submitted to SLURM; see slurm_jobs.json"))
    try:
        with executor.batch():
            jobs = [executor.submit(SlurmJob(spec, launcher, state, extras)) for spec in specs]
    except submitit.core.utils.FailedJobError as err:  # sbatch refused the array: not one job was submitted
        _unsubmitted(specs if extras else [], fresh, why := _last_line(str(err)))
        raise UserError(f"cluster=slurm: sbatch submitted none of the {len(specs)} jobs ({why}); check cluster.* "
                        "(a partition or account `sinfo` does not list?) and that SLURM runs (a one-machine "
                        "cluster: sudo bash launch/slurm-local.sh up)") from None
    log.info(f"Submitted {len(jobs)} jobs to SLURM as array {jobs[0].job_id.split('_')[0]}: {sweep_dir}")
    if not extras:  # another app: Hydra's JobReturns, as hydra-submitit-launcher returns them
        return other_app_returns(specs, jobs)
    ids = {s.num: j.job_id for s, j in zip(specs, jobs, strict=True)}
    earlier = (read_slurm_jobs(sweep_dir / "slurm_jobs.json") or {}).get("jobs", {})  # a search submits batch by batch
    write_json_atomic(sweep_dir / "slurm_jobs.json", {"jobs": {**earlier, **{str(k): v for k, v in ids.items()}},
                                                      "submitit_folder": str(folder)})
    if not settings.wait:
        print(f"Submitted SLURM jobs {', '.join(ids.values())}\nSweep directory: {sweep_dir}\n"
              f"When they have ended: python -m llmexp.report {sweep_dir}", flush=True)
        return job_returns(specs, [JobOutcome(s.num, "submitted", None, None, ids[s.num]) for s in specs])
    outcomes = wait_for_jobs(specs, jobs) | ended
    return finish_sweep(all_specs, [outcomes[s.num] for s in all_specs], launcher.within_search)


def _unsubmitted(specs: Sequence[JobSpec], fresh: list[Path], why: str) -> None:
    """After sbatch refused the jobs: a job directory this launch made goes (it held only the `submitted` record, so
    a corrected command may use the sweep directory again); an earlier launch's job records that it was not run."""
    for spec in specs:
        if spec.job_dir in fresh:
            shutil.rmtree(spec.job_dir, ignore_errors=True)
        else:
            record_outcome(spec, JobOutcome(spec.num, "failed", None, f"not submitted: {why}"))
    sweep_dir = specs[0].job_dir.parent if specs else None
    if sweep_dir and sweep_dir.resolve() != Path.cwd().resolve() and \
            {p.name for p in sweep_dir.iterdir()} <= {".submitit", "multirun.yaml", LOCK_NAME}:
        shutil.rmtree(sweep_dir, ignore_errors=True)  # this launch made all there is: status would show "missing"


def other_app_returns(specs: Sequence[JobSpec], jobs: Sequence[submitit.Job]) -> list:
    """Another app's JobReturns, waiting for each job; a job SLURM ended (cancelled, out of time or memory)
    gets a FAILED one naming why, as the local launcher gives a killed job, so every job has a return."""
    returns = []
    for spec, job in zip(specs, jobs, strict=True):
        try:
            returns.append(job.results()[0])
        except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as err:
            returns.append(failed_return(spec, f"SLURM job {job.job_id}: {_last_line(str(err))}"))
    return returns


def wait_for_jobs(specs: Sequence[JobSpec], jobs: Sequence[submitit.Job], poll_s: float = 2.0) -> dict[int, JobOutcome]:
    """Poll until every job has ended (their outcomes by job number); one sacct call per poll covers the whole array."""
    outcomes: dict[int, JobOutcome] = {}
    overrides = [spec.overrides for spec in specs]
    try:
        while len(outcomes) < len(specs):
            time.sleep(poll_s)
            jobs[0].watcher.update_if_long_enough(mode="force")
            for spec, job in zip(specs, jobs, strict=True):
                if spec.num not in outcomes and job.done() and not _still_completing(job):
                    outcome = outcomes[spec.num] = collect(spec, job)
                    record_outcome(spec, outcome)
                    log.info(f"  #{spec.num} ({job.job_id}) {outcome.status}: {swept(spec.overrides, overrides)}")
    except KeyboardInterrupt:
        log.warning(f"stopped watching; {len(specs) - len(outcomes)} jobs keep running on SLURM. "
                    f"Later: python -m llmexp.report {specs[0].job_dir.parent}")
        raise
    return outcomes


def _still_completing(job: submitit.Job) -> bool:
    """sacct says the job ended, but its processes are still finishing (a cancelled trainer saving a
    checkpoint and summary): wait for them, at most SLURM's KillWait, so the record is complete."""
    return not job.task(0).paths.result_pickle.exists() and bool(slurm_state(job.job_id))


def collect(spec: JobSpec, job: submitit.Job) -> JobOutcome:
    """A finished job's outcome: its own result (rank 0), else what sacct says happened."""
    task0 = job.task(0)  # (the job itself when it has one task)
    state = str(job.state).upper()
    if task0.paths.result_pickle.exists():
        try:
            result = task0.result()
        except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as err:
            return JobOutcome(spec.num, "failed", 1, _last_line(str(err)), job.job_id)
        if isinstance(result, dict):
            outcome = JobOutcome(**{**result, "job_id": job.job_id})
            if outcome.status == "preempted" and state.startswith(("CANCELLED", "TIMEOUT")):
                # The trainer checkpointed on SIGTERM and returned; SLURM had ended the job.
                outcome.status = _final_status(state)
                outcome.error = f"SLURM state {state}; the trainer saved a checkpoint at the signal"
            return outcome
    return JobOutcome(spec.num, _final_status(state), None, f"SLURM state {state}; logs: {task0.paths.stderr}",
                      job.job_id)


def _final_status(state: str) -> str:
    """A job that left no result: SLURM's end state as a run status (COMPLETED without a result: failed)."""
    return slurm_end_status(state) or "failed"


def _last_line(text: str) -> str:
    """sbatch's reason: its last line, but not the `Try "sbatch --help"` that follows an unknown option's."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("-") and "--help" not in ln]
    return lines[-1][:500] if lines else text[:500]
