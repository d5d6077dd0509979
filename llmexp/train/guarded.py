"""The Hydra task of one run: a composed config in, an exit code out (the CLI's run and every sweep job).

Light to import: a sweep job of any Hydra app reports a UserError through `user_error_exit`, and the
trainer (torch) is imported only when a run starts."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from llmexp.config.derived import use_shared_compile_cache
from llmexp.config.validation import validate
from llmexp.errors import STATUS_EXIT, RunFailed, UserError
from llmexp.machine.environment import check_environment
from llmexp.monitor.console import job_log
from llmexp.rundir.lock import HYDRA_FILES, LOCK_NAME, put_back_hydra_files, remove_made_parents
from llmexp.rundir.redact import print_user_error, scrub_text
from llmexp.train.preemption import PreemptionSignal


def run_guarded(cfg: DictConfig) -> int:
    """Validate, then train; return the exit code. User errors print one clear message, no traceback. The run's
    one preemption guard is entered here, before the trainer (torch) is imported: from then on SIGTERM, SIGUSR1,
    SIGUSR2 and Ctrl-C stop the run at its first step boundary, importing included."""
    try:
        with PreemptionSignal():
            validate(cfg)  # (the CLI ran both before Hydra did anything; a sweep job runs them here, in its process)
            check_environment(cfg)  # bf16 support, world size, files: before anything loads
            use_shared_compile_cache(cfg)  # before the trainer imports torch._dynamo
            from llmexp.train.train import train

            result = train(cfg)  # its own guard is this one (PreemptionSignal hands out the active one)
    except UserError as err:
        code = user_error_exit(err)
        if not isinstance(err, RunFailed):  # (steps ran: the run's directory and summary.json stay)
            _leave_refused_run_dir(str(_last_user_error))
        return code
    return STATUS_EXIT[result.status]


RUN_LOG_AND_LOCK = {"llmexp.log", LOCK_NAME}
"""Hydra's job log and the CLI's lock: in a single run's directory before the run has written anything."""


def run_start_files(subdir: str | None) -> dict[str, set[str]]:
    """What a single run's directory holds before the run has written anything: `RUN_LOG_AND_LOCK`, and Hydra's
    config files in `subdir` (`hydra.output_subdir`; null: none)."""
    if not subdir:
        return {".": RUN_LOG_AND_LOCK}
    return {".": RUN_LOG_AND_LOCK | {subdir}, subdir: set(HYDRA_FILES)}


def _leave_refused_run_dir(message: str) -> None:
    """A single run refused while it set up (a setting only torch or the data can judge, e.g. an optimizer
    argument) leaves no directory behind, as a refusal before Hydra starts does. Only a directory that holds
    nothing but `run_start_files` goes: never a resumed run's, a user's own files, or a sweep job's (its record);
    with `hydra.run.dir=.` only the start files go, never the working directory itself. A directory that stays
    (an earlier run's) keeps Hydra's config files as they were (`put_back_hydra_files`) and gets the refusal in its
    job log, where the next reader of that run looks."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.RUN:
        return
    run_dir, subdir = Path(HydraConfig.get().runtime.output_dir), HydraConfig.get().output_subdir
    def start_files_only(also: frozenset[str] = frozenset()) -> bool:
        return all({p.name for p in (run_dir / sub).iterdir()} <= names | also
                   for sub, names in run_start_files(subdir).items())

    metrics = run_dir / "metrics.jsonl"
    with contextlib.suppress(OSError):  # gone already, or not ours to judge: leave it
        if metrics.is_file() and metrics.stat().st_size == 0 and start_files_only(frozenset({metrics.name})):
            metrics.unlink()  # the logger opened it before a resume or an eval task was refused
        if not start_files_only():
            logger, own = job_log(run_dir)
            logger.error("refused: %s (no step ran; checkpoints, metrics and model/ are as they were)", message)
            if own is not None:
                own.close()
            put_back_hydra_files(run_dir)
            return
        if subdir:
            shutil.rmtree(run_dir / subdir)
        for name in RUN_LOG_AND_LOCK:
            (run_dir / name).unlink(missing_ok=True)
        if run_dir.resolve() != Path.cwd().resolve():
            run_dir.rmdir()
            remove_made_parents(run_dir)


_last_user_error: str | None = None


def user_error_exit(err: UserError) -> int:
    """Print a user's mistake as one line (secrets scrubbed), keep it for the sweep's record of this job, exit 2."""
    global _last_user_error
    _last_user_error = scrub_text(str(err))
    return print_user_error("llmexp", _last_user_error)


def last_user_error() -> str | None:
    """The message of the last user error in this process: a sweep job's record shows it, not just "exit 2"."""
    return _last_user_error
