"""The local launcher: `cluster=local` (the default) runs every job of a `--multirun` in its own
process, so a crash or a `kill -9` of one job loses only that job:

* with GPUs, side by side, one job per visible GPU (times `cluster.jobs_per_gpu`), each child
  started with its own `CUDA_VISIBLE_DEVICES`; further jobs wait for a free GPU;
* on CPU, one after another, or `cluster.max_parallel` at once.

The parent composes each job's config (so composition errors stop the sweep before anything
runs), pickles it with the task function into `<sweep dir>/.llmexp/<num>.job.pkl`, and starts
`python -m llmexp.sweep.local <pickle>`. The child runs Hydra's `run_job` (so `.hydra/` and the job
log land in `<sweep dir>/<num>/` as usual) and writes `<num>.outcome.json`; its stdout and stderr go
to `<sweep dir>/<num>/job.log`. A child that dies without an outcome is recorded from its exit
signal. What every job and sweep share with `cluster=slurm` (`llmexp.sweep.slurm`) is in `llmexp.sweep.jobs`.
Nothing here imports torch or submitit.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmexp.errors import UserError
from llmexp.paths import atomic_file, write_json_atomic
from llmexp.sweep.jobs import JobOutcome, JobSpec, compose_jobs, execute, finish_sweep, swept

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from hydra.core.utils import JobReturn

log = logging.getLogger(__name__)

_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
"""A job process ended by one of these was asked to stop: `cancelled`; SIGKILL is `killed`."""


# ----------------------------------------------------------------------------- devices


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs jobs may use: CUDA_VISIBLE_DEVICES when set (ids or UUIDs), else those nvidia-smi lists."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
        return [] if ids[:1] == ["-1"] else ids
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def device_slots(gpus: Sequence[str], jobs_per_gpu: int, max_parallel: int) -> list[str | None]:
    """One entry per job that may run at once: a CUDA_VISIBLE_DEVICES value, or None for a CPU slot.

    With GPUs, each GPU appears `jobs_per_gpu` times (interleaved, so the first jobs spread over all
    GPUs); without, there are `max_parallel` CPU slots.
    """
    if jobs_per_gpu < 1 or max_parallel < 1:
        raise UserError(f"cluster.jobs_per_gpu={jobs_per_gpu} and cluster.max_parallel={max_parallel}: "
                        "both must be >= 1; e.g. cluster.max_parallel=2")
    if gpus:
        return [gpu for _ in range(jobs_per_gpu) for gpu in gpus]
    return [None] * max_parallel


def child_env(slot: str | None, num_slots: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a job's process: its GPU, and fair CPU threads when jobs share the CPU."""
    env = dict(os.environ if base is None else base)
    if slot is not None:
        env["CUDA_VISIBLE_DEVICES"] = slot
    elif num_slots > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // num_slots))
    return env


# ----------------------------------------------------------------------------- the local launcher


@dataclass
class _Running:
    spec: JobSpec
    slot: str | None
    proc: subprocess.Popen
    outcome_path: Path
    started_s: float


def launch_local(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[JobReturn]:
    """Hydra's `launch` for `cluster=local`."""
    from hydra.core.singleton import Singleton

    cluster = launcher.config.cluster
    specs = compose_jobs(launcher, job_overrides, initial_job_idx)
    slots = device_slots(visible_gpus(), int(cluster.get("jobs_per_gpu", 1)), int(cluster.get("max_parallel", 1)))
    if not cluster.get("wait", True):
        log.warning("cluster.wait=false applies to cluster=slurm; local jobs run to the end here")
    work = specs[0].job_dir.parent / ".llmexp"
    work.mkdir(parents=True, exist_ok=True)
    state = Singleton.get_state()
    for spec in specs:
        _dump_job(work / f"{spec.num}.job.pkl", (spec, launcher.task_function, launcher.hydra_context, state))
    where = f"GPUs {sorted(set(s for s in slots if s))}" if slots[0] is not None else "CPU"
    log.info(f"Launching {len(specs)} jobs locally, {len(slots)} at a time on {where}: {specs[0].job_dir.parent}")
    outcomes = _run_queue(specs, slots, work)
    shutil.rmtree(work, ignore_errors=True)  # the pickles; outcomes are recorded by finish_sweep
    return finish_sweep(specs, [outcomes[s.num] for s in specs])


def _dump_job(path: Path, payload: tuple) -> None:
    import cloudpickle  # by value for functions defined in __main__ (python -m llmexp, test apps)

    with atomic_file(path, "wb") as f:
        cloudpickle.dump(payload, f)


def _run_queue(specs: Sequence[JobSpec], slots: list[str | None], work: Path) -> dict[int, JobOutcome]:
    """Start jobs as slots free up; collect an outcome for every job, whatever happens to it."""
    pending, free = deque(specs), list(slots)
    running: list[_Running] = []
    outcomes: dict[int, JobOutcome] = {}
    try:
        while pending or running:
            while pending and free:
                spec = pending.popleft()
                running.append(_start(spec, free.pop(0), len(slots), work, swept(spec, specs)))
            time.sleep(0.1)
            for job in [j for j in running if j.proc.poll() is not None]:
                running.remove(job)
                free.append(job.slot)
                outcomes[job.spec.num] = _collect(job)
    except KeyboardInterrupt:
        log.warning("interrupted: asking running jobs to checkpoint and stop (SIGTERM)")
        for job in running:
            _stop(job)
            outcomes[job.spec.num] = _collect(job)
        for spec in pending:
            outcomes[spec.num] = JobOutcome(spec.num, "cancelled", None, "the sweep was interrupted before it started")
    return outcomes


def _start(spec: JobSpec, slot: str | None, num_slots: int, work: Path, label: str) -> _Running:
    spec.job_dir.mkdir(parents=True, exist_ok=True)
    outcome_path = work / f"{spec.num}.outcome.json"
    outcome_path.unlink(missing_ok=True)
    with open(spec.job_dir / "job.log", "ab") as job_log:
        # A new session: Ctrl-C in the terminal reaches the launcher only, which stops jobs cleanly.
        proc = subprocess.Popen([sys.executable, "-m", "llmexp.sweep.local", str(work / f"{spec.num}.job.pkl"),
                                 str(outcome_path)], stdout=job_log, stderr=subprocess.STDOUT,
                                env=child_env(slot, num_slots), start_new_session=True)
    device = f"GPU {slot}" if slot is not None else "CPU"
    log.info(f"  #{spec.num} started (pid {proc.pid}, {device}): {' '.join(spec.overrides)}")
    return _Running(spec, slot, proc, outcome_path, time.monotonic())


def _stop(job: _Running, grace_s: float = 120.0) -> None:
    """SIGTERM (the trainer checkpoints at the next step and ends `preempted`), then SIGKILL."""
    job.proc.terminate()
    try:
        job.proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        job.proc.kill()
        job.proc.wait()


def _collect(job: _Running) -> JobOutcome:
    """The child's own outcome, or one inferred from how the process ended."""
    num, code = job.spec.num, job.proc.returncode
    try:
        outcome = JobOutcome(**json.loads(job.outcome_path.read_text()))
    except (OSError, ValueError, TypeError):
        if code is not None and code < 0:
            sig = signal.Signals(-code)
            status = "cancelled" if sig in _STOP_SIGNALS else "killed" if sig == signal.SIGKILL else "failed"
            outcome = JobOutcome(num, status, code, f"the job process was killed by {sig.name}")
        else:
            outcome = JobOutcome(num, "failed", code, f"the job process exited with code {code} without an outcome; "
                                 f"see {job.spec.job_dir / 'job.log'}")
    took_s = time.monotonic() - job.started_s
    log.info(f"  #{num} {outcome.status} after {took_s:.1f} s (exit {outcome.exit_code})")
    return outcome


def main(argv: Sequence[str] | None = None) -> int:
    """The job process: `python -m llmexp.sweep.local JOB_PICKLE OUTCOME_JSON`."""
    import cloudpickle

    job_path, outcome_path = (sys.argv[1:] if argv is None else list(argv))[:2]
    with open(job_path, "rb") as f:
        spec, task_function, hydra_context, state = cloudpickle.load(f)
    outcome = execute(spec, task_function, hydra_context, state)
    write_json_atomic(Path(outcome_path), outcome.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
