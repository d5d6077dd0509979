"""submitit's own requeue test (`test_requeuing_checkpointable` in `submitit/slurm/test_slurm.py`, in the wheel),
replayed on llmexp's side of the protocol: llmexp's `SlurmJob` as the checkpointable callable, and llmexp's
`_requeue_or_stop` calling submitit's SIGUSR2 handler after the trainer checkpointed, as it does on a node.
submitit's own mocks (sbatch, the requeue) and clock, so it needs no cluster and takes a second;
tests/test_slurm.py runs the same protocol for real on the local slurmctld, where a requeue budget is not
cheap to exhaust, and this is where running out of it (`cluster.max_num_timeout`) is checked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import submitit
from omegaconf import OmegaConf
from submitit.conftest import fast_forward_clock  # submitit's clock fixture  # noqa: F401
from submitit.slurm.test_slurm import get_signal_handler, mock_requeue, mocked_slurm

import llmexp.sweep.slurm as slurm_module
from llmexp.sweep.jobs import JobOutcome, JobSpec
from llmexp.sweep.slurm import SlurmJob, _requeue_or_stop


def preempted(job_id: str) -> JobOutcome:
    """What llmexp's task returns after a signal: the trainer saved a checkpoint and stopped."""
    return JobOutcome(0, "preempted", 1, None, job_id)


def test_submitits_requeue_protocol_through_llmexps_slurm_job(
        tmp_path: Path, fast_forward_clock: Callable[..., None],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = JobSpec(0, ["lr=1e-3"], OmegaConf.create({"train": {"resume": "never"}}), tmp_path / "0")
    with mocked_slurm():  # as submitit's test: a 60-minute job, one timeout allowed
        executor = submitit.SlurmExecutor(folder=tmp_path, max_num_timeout=1)
        executor.update_parameters(time=60)
        job = executor.submit(SlurmJob(spec, launcher=None, singleton_state=None))
    monkeypatch.setattr(slurm_module, "slurm_state", lambda job_id: "RUNNING")  # squeue: still running

    def resubmitted() -> submitit.helpers.DelayedSubmission:
        return submitit.helpers.DelayedSubmission.load(job.paths.submitted_pickle)

    # A signal 30 minutes in is a preemption, not a timeout: requeued, the countdown kept.
    sig = get_signal_handler(job)
    fast_forward_clock(minutes=30)
    with pytest.raises(SystemExit), mock_requeue(called_with=1):
        _requeue_or_stop(preempted(job.job_id), sig.checkpoint_and_try_requeue)
    again = resubmitted()
    assert isinstance(again.function, SlurmJob) and again.function.spec.config.train.resume == "auto"
    assert again.function.spec.job_dir == spec.job_dir and again._timeout_countdown == 1

    # 50 minutes into the next attempt is a timeout: requeued, the countdown down to 0.
    sig = get_signal_handler(job)
    fast_forward_clock(minutes=50)
    with pytest.raises(SystemExit), mock_requeue(called_with=0):
        _requeue_or_stop(preempted(job.job_id), sig.checkpoint_and_try_requeue)
    assert resubmitted()._timeout_countdown == 0

    # A second timeout: no requeue left, so the job ends `timeout` with submitit's reason (not a crash).
    sig = get_signal_handler(job)
    fast_forward_clock(minutes=55)
    with mock_requeue(not_called=True):
        outcome = _requeue_or_stop(preempted(job.job_id), sig.checkpoint_and_try_requeue)
    assert outcome.status == "timeout" and "timed-out too many times" in str(outcome.error), outcome

    # SLURM itself ended the job (scancel): it is never requeued from inside, and says cancelled.
    monkeypatch.setattr(slurm_module, "slurm_state", lambda job_id: "CANCELLED")
    with mock_requeue(not_called=True):
        outcome = _requeue_or_stop(preempted(job.job_id), get_signal_handler(job).checkpoint_and_try_requeue)
    assert outcome.status == "cancelled" and "not requeued" in str(outcome.error), outcome


def test_the_requeues_own_sigterm_does_not_fail_the_requeue(
        tmp_path: Path, fast_forward_clock: Callable[..., None],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`scontrol requeue`, which submitit runs from inside the job, makes slurmctld SIGTERM every process of
    the job, that scontrol too. Seen on the local cluster (1 of 8 requeues here): scontrol died of it before
    exiting 0, submitit took the done requeue for a failure, and the attempt recorded `preempted` (the
    sweep exited 1) while the job ran again and completed. Here submitit's real requeue runs a fake
    scontrol that gets its SIGTERM before it exits, as the real one can."""
    with mocked_slurm():
        executor = submitit.SlurmExecutor(folder=tmp_path, max_num_timeout=3)
        executor.update_parameters(time=60)
        spec = JobSpec(0, [], OmegaConf.create({"train": {"resume": "never"}}), tmp_path / "0")
        job = executor.submit(SlurmJob(spec, launcher=None, singleton_state=None))
    calls = tmp_path / "scontrol_calls"
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nkill -TERM $$\nexit 0\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{scontrol.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", job.job_id)
    monkeypatch.setattr(slurm_module, "slurm_state", lambda job_id: "RUNNING")
    before = signal.getsignal(signal.SIGTERM)
    sig = get_signal_handler(job)
    fast_forward_clock(minutes=55)
    with pytest.raises(SystemExit):  # submitit's exit after a requeue: nothing recorded, the job runs again
        _requeue_or_stop(preempted(job.job_id), sig.checkpoint_and_try_requeue)
    assert calls.read_text().split() == ["requeue", job.job_id]
    assert signal.getsignal(signal.SIGTERM) == before  # this process's handler is back


LATE_WARNING = """
import gc, os, signal, sys
from llmexp.sweep.slurm import job_over
signal.signal(signal.SIGUSR2, lambda *_: sys.exit(7))  # stands in for submitit's handler: it would requeue
if sys.argv[1] == "finished":
    job_over()
os.kill(os.getpid(), signal.SIGUSR2)  # the time-limit warning, a few seconds after the job's last step
print("exited as it finished; frozen", gc.get_freeze_count() > 0)
"""


@pytest.mark.parametrize(("outcome", "code"), [("finished", 0), ("running", 7)])
def test_a_warning_after_the_outcome_is_final_changes_nothing(outcome: str, code: int) -> None:
    """A job whose last attempt ends just before SLURM's time-limit warning: the warning must neither requeue it
    nor kill it on its way out (SLURM recorded such a completed job FAILED). While it runs, the handler acts."""
    done = subprocess.run([sys.executable, "-c", LATE_WARNING, outcome], capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr[-2000:]
    assert ("exited as it finished; frozen True" in done.stdout) == (code == 0)  # and left out of the exit's GC
