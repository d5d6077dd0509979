"""Sweep jobs: composing them, running one, recording how it ended, and the local launcher.

`cluster=local` (the default) runs every job of a `--multirun` in its own process, so a crash or a
`kill -9` of one job loses only that job:

* with GPUs, side by side, one job per visible GPU (times `cluster.jobs_per_gpu`), each child
  started with its own `CUDA_VISIBLE_DEVICES`; further jobs wait for a free GPU;
* on CPU, one after another, or `cluster.max_parallel` at once.

The parent composes each job's config (so composition errors stop the sweep before anything
runs), pickles it with the task function into `<sweep dir>/.llmexp/<num>.job.pkl`, and starts
`python -m llmexp.launcher <pickle>`. The child runs Hydra's `run_job` (so `.hydra/` and the job
log land in `<sweep dir>/<num>/` as usual) and writes `<num>.outcome.json`; its stdout and stderr go
to `<sweep dir>/<num>/job.log`. A child that dies without an outcome is recorded from its exit
signal. Every job that does not end `completed` gets `<job dir>/job_status.json`; then the sweep
report is written and the command exits 1 if any job did not finish.

`llmexp.slurm` reuses `compose_jobs`, `execute` and `finish_sweep` for `cluster=slurm`.
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
import traceback
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmexp.errors import UserError
from llmexp.paths import register_resolvers, write_json_atomic

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from hydra.core.utils import JobReturn

log = logging.getLogger(__name__)

FINISHED = ("completed", "early_stopped")
"""Statuses of a job that ended as intended; any other makes the sweep exit non-zero."""
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
"""A job process ended by one of these was asked to stop: `cancelled`; SIGKILL is `killed`."""
_launched = False


def register_launchers() -> None:
    """Make Hydra know llmexp's launcher classes even where it cannot walk `hydra_plugins`.

    setuptools' strict editable installs map `hydra_plugins.llmexp_launcher` through an import
    hook that `pkgutil.walk_packages` cannot list, so Hydra's plugin scan misses it when
    `python -m llmexp` runs outside the checkout. Call before `hydra.main` runs the app.
    """
    from hydra.core.plugins import Plugins

    from hydra_plugins.llmexp_launcher import llmexp_launcher as plugin

    plugins = Plugins.instance()
    for cls in (plugin.LocalLauncher, plugin.SlurmLauncher):
        plugins._register(cls)  # Hydra's own registration step; idempotent


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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- composing and running


def compose_jobs(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int,
                 compose: bool = True) -> list[JobSpec]:
    """Every job's spec, its sweep directory pinned; its config composed now unless `compose=False`.

    `hydra.sweep.dir` is resolved once here: its `${llmexp_run_id:}` must not be re-evaluated
    in a child process or on a SLURM node, where time and pid differ. Composition takes ~0.3 s a
    job (Hydra's sweeper has already composed each once to validate it), so the SLURM launcher
    leaves it to the node (`compose_job`); the job directory is then derived from the sweep config
    unless `hydra.sweep.subdir` names the overrides, which only a composition knows.
    """
    from omegaconf import OmegaConf, open_dict

    global _launched
    _launched = True
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir)).absolute()
    with open_dict(launcher.config):
        launcher.config.hydra.sweep.dir = str(sweep_dir)
    raw_subdir = str(OmegaConf.to_container(launcher.config.hydra.sweep, resolve=False).get("subdir"))
    compose = compose or "override" in raw_subdir
    specs, sweep_probe = [], OmegaConf.create({"hydra": OmegaConf.to_container(launcher.config.hydra)})
    for offset, overrides in enumerate(job_overrides):
        num = initial_job_idx + offset
        cfg = compose_job(launcher, list(overrides), num) if compose else None
        probe = cfg if cfg is not None else sweep_probe
        with open_dict(probe):
            probe.hydra.job.num = num
        subdir = str(OmegaConf.select(probe, "hydra.sweep.subdir"))
        specs.append(JobSpec(num=num, overrides=list(overrides), config=cfg, job_dir=sweep_dir / subdir))
    return specs


def compose_job(launcher: Any, overrides: list[str], num: int) -> Any:
    """One job's config, as Hydra's basic launcher composes it."""
    from omegaconf import open_dict

    cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
    with open_dict(cfg):
        cfg.hydra.job.id = str(num)
        cfg.hydra.job.num = num
    return cfg


def run_status(job_dir: Path) -> str | None:
    """The status the trainer wrote to `summary.json`, or None when there is none (yet)."""
    try:
        status = json.loads((Path(job_dir) / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None
    return str(status) if status else None


def execute(spec: JobSpec, task_function: Any, hydra_context: Any, singleton_state: Any) -> JobOutcome:
    """Run one job in this process through Hydra's `run_job`; never raises for a failing task."""
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobStatus, run_job, setup_globals

    register_resolvers()
    Singleton.set_state(singleton_state)
    setup_globals()
    ret = run_job(hydra_context=hydra_context, task_function=task_function, config=spec.config,
                  job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
    if ret.status == JobStatus.COMPLETED:
        value = ret._return_value
        code = value if isinstance(value, int) and not isinstance(value, bool) else 0
        status = run_status(spec.job_dir) or ("completed" if code == 0 else "failed")
        return JobOutcome(spec.num, status, code, None if code == 0 else f"the task exited with code {code}")
    err = ret._return_value
    traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    return JobOutcome(spec.num, "failed", 1, f"{type(err).__name__}: {err}")


# ----------------------------------------------------------------------------- recording


def record_outcome(spec: JobSpec, outcome: JobOutcome) -> None:
    """Leave `job_status.json` in the job dir of every job that did not complete or left no summary.json.

    When present it is the launcher's verdict (a trainer's summary may say `preempted` for a job
    SLURM then cancelled); a job that ended well with its own summary has none, so a stale one
    (`submitted`, or from an earlier attempt) is removed. Its `overrides` name a job that never
    started; `.hydra/overrides.yaml` is also written for it, as Hydra would have.
    """
    status_path = spec.job_dir / "job_status.json"
    ended_well = outcome.status in FINISHED and outcome.exit_code in (0, None)
    if ended_well and (spec.job_dir / "summary.json").exists():
        status_path.unlink(missing_ok=True)
        return
    write_json_atomic(status_path, {**outcome.to_json(), "overrides": spec.overrides})
    overrides_yaml = spec.job_dir / ".hydra" / "overrides.yaml"
    if not overrides_yaml.exists():  # what Hydra would have written, so reports show the job's settings
        import yaml

        overrides_yaml.parent.mkdir(parents=True, exist_ok=True)
        tmp = overrides_yaml.with_name(f".overrides.{os.getpid()}.tmp")
        tmp.write_text(yaml.safe_dump(spec.overrides))
        os.replace(tmp, overrides_yaml)


def write_report(sweep_dir: Path) -> None:
    """The sweep report (llmexp.sweep_report); a failing report must not hide the jobs' outcomes."""
    try:
        from llmexp.sweep_report import write_sweep_report
    except ImportError as err:
        log.warning(f"sweep report skipped ({err}); run `python -m llmexp.report {sweep_dir}` later")
        return
    try:
        write_sweep_report(sweep_dir)
    except Exception as err:  # report bugs must not turn a finished sweep into a crash
        log.warning(f"writing the sweep report failed: {type(err).__name__}: {err}")
    else:
        log.info(f"Sweep report: {sweep_dir / 'sweep_report.md'}")


def job_returns(specs: Sequence[JobSpec], outcomes: Sequence[JobOutcome]) -> list[JobReturn]:
    """What Hydra expects back: one COMPLETED JobReturn per job, its value the job's exit code.

    Failures are reported by `finish_sweep` (report, summary line, exit code), not by raising the
    first job's exception from Hydra's sweeper, which would hide the others.
    """
    from hydra.core.utils import JobReturn, JobStatus

    returns = []
    for spec, outcome in zip(specs, outcomes, strict=True):
        name = str(spec.config.hydra.job.name) if spec.config is not None else None
        ret = JobReturn(overrides=spec.overrides, working_dir=os.getcwd(), task_name=name, status=JobStatus.COMPLETED)
        ret.return_value = outcome.exit_code
        returns.append(ret)
    return returns


def swept(spec: JobSpec, specs: Sequence[JobSpec]) -> str:
    """A job's overrides that differ between jobs (`lr=0.001 batch_size=4`), for one-line logs."""
    varying = [o for o in spec.overrides if any(o not in other.overrides for other in specs)]
    return " ".join(varying or spec.overrides)


def finish_sweep(specs: Sequence[JobSpec], outcomes: Sequence[JobOutcome]) -> list[JobReturn]:
    """Record every outcome, write the sweep report, print a summary; exit 1 if any job did not finish."""
    for spec, outcome in zip(specs, outcomes, strict=True):
        record_outcome(spec, outcome)
    sweep_dir = specs[0].job_dir.parent
    write_report(sweep_dir)
    bad = [o for o in outcomes if o.status not in FINISHED]
    for spec, outcome in zip(specs, outcomes, strict=True):
        detail = f": {outcome.error}" if outcome.error and outcome.status not in FINISHED else ""
        log.info(f"  #{spec.num} {outcome.status:<13} {swept(spec, specs)}{detail}")
    if bad:
        log.error(f"{len(bad)} of {len(outcomes)} jobs did not finish; see {sweep_dir}")
        raise SystemExit(1)
    return job_returns(specs, outcomes)


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

    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        cloudpickle.dump(payload, f)
    os.replace(tmp, path)


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
        proc = subprocess.Popen([sys.executable, "-m", "llmexp.launcher", str(work / f"{spec.num}.job.pkl"),
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
    """The job process: `python -m llmexp.launcher JOB_PICKLE OUTCOME_JSON`."""
    import cloudpickle

    job_path, outcome_path = (sys.argv[1:] if argv is None else list(argv))[:2]
    with open(job_path, "rb") as f:
        spec, task_function, hydra_context, state = cloudpickle.load(f)
    outcome = execute(spec, task_function, hydra_context, state)
    write_json_atomic(Path(outcome_path), outcome.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
