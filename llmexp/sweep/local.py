"""`hydra/launcher=llmexp_local` (llmexp's `cluster=local`, the default): every job of a `--multirun` in its own
process, `jobs_per_gpu` per visible GPU or `max_parallel` on CPU (docs/how-to/sweeps.md, "Jobs on this machine").

The parent composes each config (so composition errors stop the sweep before anything runs) and pickles it into
`<sweep dir>/.llmexp/<num>.job.pkl` for `python -m llmexp.sweep.local <pickle>`, which writes `<num>.outcome.json`.
CPU jobs fork from a preloaded server (`_WarmJob`); GPU jobs get a fresh process, as CUDA must initialise in the
job's own process. The launcher's process imports neither torch nor submitit.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import cloudpickle  # by value for functions defined in __main__ (python -m llmexp, test apps)
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus

from llmexp.errors import UserError
from llmexp.process import run_entry
from llmexp.rundir.files import atomic_file, write_json_atomic
from llmexp.rundir.readers import Damaged, load_json, read_bytes, reader
from llmexp.sweep.jobs import (
    JobOutcome,
    JobSpec,
    StopRequest,
    compose_jobs,
    execute,
    failed_return,
    finish_sweep,
    is_llmexp_config,
    record_outcome,
    run_task,
    split_ended,
)

log = logging.getLogger(__name__)

_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


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


def device_slots(gpus: Sequence[str], jobs_per_gpu: int, max_parallel: int,
                 prefix: str = "hydra.launcher.") -> list[str | None]:
    """One entry per job that may run at once: a CUDA_VISIBLE_DEVICES value (each GPU `jobs_per_gpu` times,
    interleaved so the first jobs spread over all GPUs), or None for each of `max_parallel` CPU slots. `prefix`
    spells the keys in an error as the user wrote them (`cluster.` for llmexp)."""
    if jobs_per_gpu < 1 or max_parallel < 1:
        raise UserError(f"{prefix}jobs_per_gpu={jobs_per_gpu} and {prefix}max_parallel={max_parallel}: "
                        f"both must be >= 1; e.g. {prefix}max_parallel=2")
    return [gpu for _ in range(jobs_per_gpu) for gpu in gpus] if gpus else [None] * max_parallel


def child_env(slot: str | None, num_slots: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a job's process: its GPU, and fair CPU threads when jobs share the CPU."""
    env = dict(os.environ if base is None else base)
    if slot is not None:
        env["CUDA_VISIBLE_DEVICES"] = slot
    elif num_slots > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // num_slots))
    return env


@dataclass
class _Running:
    spec: JobSpec
    slot: str | None
    proc: subprocess.Popen | _WarmJob
    outcome_path: Path
    started_s: float


def launch_local(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[JobReturn]:
    """Hydra's `launch` for `hydra/launcher=llmexp_local`."""
    settings, extras = launcher.settings, is_llmexp_config(launcher.config)
    specs = compose_jobs(launcher, job_overrides, initial_job_idx)
    slots = device_slots(visible_gpus(), int(settings.jobs_per_gpu), int(settings.max_parallel),
                         prefix="cluster." if extras else "hydra.launcher.")  # the spelling the user knows
    to_run, outcomes = split_ended(specs) if extras else (specs, {})  # (refuses another sweep's dir: before writing)
    work = specs[0].job_dir.parent / ".llmexp"  # (made by the first pickle's atomic_file)
    state = Singleton.get_state()
    for spec in specs:
        with atomic_file(work / f"{spec.num}.job.pkl", "wb") as f:
            cloudpickle.dump((spec, launcher.task_function, launcher.hydra_context, state, extras), f)
    where = f"GPUs {sorted(set(s for s in slots if s))}" if slots[0] is not None else "CPU"
    log.info(f"Launching {len(specs)} jobs locally, {len(slots)} at a time on {where}: {specs[0].job_dir.parent}")
    for spec in to_run if extras else ():  # `llmexp.status` shows the jobs that wait for a slot
        record_outcome(spec, JobOutcome(spec.num, "queued", None, "waiting for a free slot"))
    trains = getattr(launcher.task_function, "__module__", "").startswith("llmexp.")  # `python -m llmexp`'s task
    warm = trains and slots[0] is None and _warm_server()  # (the task whose imports a warm job saves)
    with StopRequest() as stop:  # Ctrl-C: the jobs are stopped and recorded, then the sweeper gets it
        outcomes.update(_run_queue(to_run, slots, work, warm, stop))
        returns = None if extras else [_job_return(s, outcomes[s.num], work) for s in specs]
        shutil.rmtree(work, ignore_errors=True)  # the pickles; llmexp's outcomes are recorded by finish_sweep
        return returns if returns is not None else finish_sweep(specs, [outcomes[s.num] for s in specs],
                                                                launcher.within_search)


def _job_return(spec: JobSpec, outcome: JobOutcome, work: Path) -> JobReturn:
    """Another app's job: the JobReturn its process pickled, or a FAILED one saying how the process ended."""
    returned = read_pickle(work / f"{spec.num}.return.pkl")
    return returned or failed_return(spec, outcome.error or f"job #{spec.num} ended {outcome.status}")


@reader
def read_pickle(path: Path) -> Any:
    """A pickle this launcher or its job process wrote (a job's spec, another app's JobReturn)."""
    data = read_bytes(path, None)
    try:
        return cloudpickle.loads(data)
    except Exception as err:  # UnpicklingError, EOFError, AttributeError ...: whatever the bytes made pickle do
        raise Damaged(path, f"not a whole pickle ({type(err).__name__})") from None


@reader
def read_outcome(path: Path) -> JobOutcome:
    """A job process's own outcome, which `main` writes as the job ends."""
    data = load_json(path, read_outcome)
    return JobOutcome(**{f.name: data[f.name] for f in fields(JobOutcome) if f.name in data})


def _run_queue(specs: Sequence[JobSpec], slots: list[str | None], work: Path, warm: bool,
               stop: StopRequest) -> dict[int, JobOutcome]:
    """Start jobs as slots free up until `stop` is requested; an outcome for every job, however it ends, and
    return only once none runs."""
    pending, free = deque(specs), list(slots)
    running: list[_Running] = []
    outcomes: dict[int, JobOutcome] = {}
    try:
        while (pending or running) and not stop.count:
            while pending and free and not stop.count:
                running.append(_start(pending.popleft(), free.pop(0), len(slots), work, warm))
                warm = warm and isinstance(running[-1].proc, _WarmJob)  # else its server failed: fresh from now on
            time.sleep(0.1)
            for job in [j for j in running if j.proc.poll() is not None]:
                running.remove(job)
                free.append(job.slot)
                outcomes[job.spec.num] = _collect(job)
            if warm and (orphan := next((j for j in running if j.proc.lost_server), None)):  # (all warm)
                warm = _cold(f"died; job #{orphan.spec.num} (pid {orphan.proc.pid}) runs on, still watched")
    finally:  # a stop asked for, or an error here: no job outlives the sweep
        _stop_all(running, stop)
    outcomes.update({job.spec.num: _collect(job) for job in running})
    return outcomes | {s.num: JobOutcome(s.num, "cancelled", None, "the sweep was interrupted before it started")
                       for s in pending}


def _start(spec: JobSpec, slot: str | None, num_slots: int, work: Path, warm: bool) -> _Running:
    """Start a job's process: forked from the fork server when `warm` and the server serves it, else fresh."""
    spec.job_dir.mkdir(parents=True, exist_ok=True)
    (spec.job_dir / "job_status.json").unlink(missing_ok=True)  # `queued` (or an earlier launch's verdict) no more
    outcome_path = work / f"{spec.num}.outcome.json"
    outcome_path.unlink(missing_ok=True)
    args, env = [str(work / f"{spec.num}.job.pkl"), str(outcome_path)], child_env(slot, num_slots)
    proc: subprocess.Popen | _WarmJob | None = None
    if warm:
        try:
            proc = _WarmJob(args, spec.job_dir / "job.log", env)
        except (OSError, EOFError) as err:  # the server died before it forked the job (at start-up: importing)
            warm = _cold(f"died before it started job #{spec.num} ({type(err).__name__}: {err})")
    if proc is None:
        with open(spec.job_dir / "job.log", "ab") as job_log:
            # A new session: Ctrl-C in the terminal reaches the launcher only, which stops jobs cleanly.
            proc = subprocess.Popen([sys.executable, "-m", "llmexp.sweep.local", *args], stdout=job_log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
    device = f"GPU {slot}" if slot is not None else "CPU"
    log.info(f"  #{spec.num} started (pid {proc.pid}, {device}{', warm' if warm else ''}): {' '.join(spec.overrides)}")
    return _Running(spec, slot, proc, outcome_path, time.monotonic())


def _stop_all(running: Sequence[_Running], stop: StopRequest, grace_s: float = 120.0) -> None:
    """SIGTERM to every running job (the trainer checkpoints at its next step and ends `preempted`), SIGKILL after
    `grace_s` or at a second Ctrl-C; return once every one has ended."""
    alive = [job for job in running if job.proc.poll() is None]
    if alive:
        log.warning("interrupted: asking running jobs to checkpoint and stop (SIGTERM; Ctrl-C again kills them)")
    for job in alive:
        job.proc.send_signal(signal.SIGTERM)
    asked, deadline = stop.count, time.monotonic() + grace_s
    while any(job.proc.poll() is None for job in alive):
        for job in alive if stop.count > asked or time.monotonic() > deadline else ():
            job.proc.send_signal(signal.SIGKILL)
        time.sleep(0.1)


def _collect(job: _Running) -> JobOutcome:
    """The child's own outcome, or one from how the process ended (a stop signal: `cancelled`, SIGKILL: `killed`)."""
    num, code = job.spec.num, job.proc.returncode
    outcome = read_outcome(job.outcome_path)
    if outcome is None:
        if code is not None and code < 0:
            sig = signal.Signals(-code)
            status = "cancelled" if sig in _STOP_SIGNALS else "killed" if sig == signal.SIGKILL else "failed"
            outcome = JobOutcome(num, status, code, f"the job process was killed by {sig.name}")
        else:
            lost = isinstance(job.proc, _WarmJob) and job.proc.lost_server
            how = "ended (how is unknown: its fork server had died)" if lost else f"exited with code {code}"
            outcome = JobOutcome(num, "failed", code, f"the job process {how} without an outcome; "
                                 f"see {job.spec.job_dir / 'job.log'}")
    log.info(f"  #{num} {outcome.status} after {time.monotonic() - job.started_s:.1f} s (exit {outcome.exit_code})")
    return outcome


PRELOAD = ["llmexp.train.train", "transformers.models.llama.modeling_llama", "accelerate", "matplotlib.pyplot"]
"""What the fork server imports once per sweep: the trainer (and with it torch), and what a run imports only when
it gets there: transformers' modelling stack, Accelerate, matplotlib (its backend is chosen when a job first draws).
Without the last three a warm job still spent ~4 s of its ~6 s of start-up importing (2-core AMD EPYC Zen 3)."""


def _warm_server() -> bool:
    """Start the fork server of warm jobs (its imports run while the launcher goes on); False, with a warning,
    where it cannot start: the jobs then start fresh. Warm jobs need a pidfd to be watched by (Linux)."""
    if "forkserver" not in multiprocessing.get_all_start_methods() or not hasattr(os, "pidfd_open"):
        return False
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(PRELOAD)
    try:
        os.close(os.pidfd_open(os.getpid()))  # Linux >= 5.3
        forkserver.ensure_running()
    except OSError as err:  # Python < 3.13 puts its socket under TMPDIR: a long TMPDIR is too long for AF_UNIX
        return _cold(f"did not start ({err})")
    return True


def _cold(why: str) -> bool:
    log.warning(f"jobs start fresh processes: the fork server of warm jobs {why}")
    return False


class _WarmJob:
    """A CPU job forked from the sweep's fork server (`PRELOAD` imported once: it skips the ~3 s of CPU a fresh
    process spends on imports), with the part of Popen's interface the queue uses. The job is the server's child, so
    its end is learnt, and it is signalled, through its pidfd (never a reused pid), whether or not the server lives;
    a server that dies leaves its jobs running, watched (`lost_server`), their exit status unknown (255)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str]) -> None:
        context = multiprocessing.get_context("forkserver")  # the server `_warm_server` started
        self.process = context.Process(target=_warm_main, args=(args, str(log_path), env), name="llmexp-job")
        self.process.start()  # OSError, EOFError: the server died before it forked the job
        self.pid, self.pidfd = self.process.pid, os.pidfd_open(self.process.pid)  # (it is still reading its pickle)
        self.returncode: int | None = None
        self.lost_server = False

    def poll(self) -> int | None:
        """The exit status (-N for signal N, as Popen's) once the job has ended, else None."""
        if self.returncode is None and _readable(self.pidfd):  # ended; a live server reports how at once
            self.process.join(30)
            self.returncode = 255 if self.process.exitcode is None else self.process.exitcode
            os.close(self.pidfd)
        elif self.returncode is None and not self.lost_server and _readable(self.process.sentinel):
            self.lost_server = True  # the status pipe is at EOF while the job runs: the server died
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended just now
                signal.pidfd_send_signal(self.pidfd, sig)


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def _warm_main(args: list[str], log_path: str, env: dict[str, str]) -> None:
    """A warm job's process, set up as `_start` sets up a fresh one: a session of its own (Ctrl-C reaches the
    launcher only), stdout and stderr appended to job.log, the job's environment; then the same `main`."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for std in (1, 2):
        os.dup2(fd, std)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # OpenMP read it when the server loaded torch: this job's share of the cores
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [__file__, *args]
    sys.exit(main(args))  # (multiprocessing flushes stdout and stderr as the process ends)


def main(argv: Sequence[str] | None = None) -> int:
    """The job process: `python -m llmexp.sweep.local JOB_PICKLE OUTCOME_JSON`."""
    job_path, outcome_path = (sys.argv[1:] if argv is None else list(argv))[:2]
    if (job := read_pickle(Path(job_path))) is None:
        return 1
    *task, extras = job  # (spec, task function, Hydra context, singleton state), as `launch_local` pickled it
    outcome = execute(*task) if extras else _run_other_app(*task, Path(outcome_path))
    write_json_atomic(Path(outcome_path), asdict(outcome))
    return 0


def _run_other_app(spec: JobSpec, task_function: Any, hydra_context: Any, state: Any, outcome_path: Path) -> JobOutcome:
    """Another app's job: Hydra's JobReturn pickled beside the outcome for the launcher to hand back."""
    ret = run_task(spec, task_function, hydra_context, state)
    try:
        payload = cloudpickle.dumps(ret)
    except Exception as err:  # an unpicklable return value: the job failed as far as Hydra can tell
        payload = cloudpickle.dumps(failed_return(spec, f"the job's return value cannot be pickled: {err}"))
    with atomic_file(outcome_path.with_name(f"{spec.num}.return.pkl"), "wb") as f:
        f.write(payload)
    ok = ret.status == JobStatus.COMPLETED
    return JobOutcome(spec.num, "completed" if ok else "failed", 0 if ok else 1,
                      None if ok else f"{type(ret._return_value).__name__}: {ret._return_value}")


if __name__ == "__main__":  # a job in a fresh process (a warm job's fork ends with multiprocessing's os._exit)
    run_entry(main)
