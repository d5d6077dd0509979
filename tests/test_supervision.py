"""Every process a sweep starts stays supervised: the local launcher's fork server of warm jobs killed at start-up
and mid-job, and Ctrl-C landing as a search's trial ends.

Real sweeps through the CLI, tiny runs; the process table is sampled while they run (`JobWatch`), warm jobs and
fresh ones alike. The mid-job test's steps are paced (tests/pace/), so the window between two steps is known.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import TINY, paced_env, read_metrics, run_cli
from tests.test_search import _study, _wait_for

pytestmark = pytest.mark.slow
ENV = {"OMP_NUM_THREADS": "1"}


def start_sweep(args: list[str], sweep_dir: Path, env: dict[str, str]) -> subprocess.Popen:
    """`python -m llmexp --multirun ARGS` in a process group of its own, as a terminal starts a command, with
    Ctrl-C's usual meaning (pytest-xdist's workers ignore SIGINT, and a child would inherit that)."""
    with open(sweep_dir.parent / f"{sweep_dir.name}.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "llmexp", "--multirun", *TINY, *args,
                                 f"hydra.sweep.dir={sweep_dir}"], cwd=sweep_dir.parent, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **ENV, **env}, process_group=0,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def sweep_log(sweep_dir: Path) -> str:
    return (sweep_dir.parent / f"{sweep_dir.name}.log").read_text()


def _processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command name: state, ppid, pgrp, session, ...)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            yield int(pid), Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue


class JobWatch:
    """The jobs of a sweep (or of one job, given its directory) in the process table. A job is a session (each
    job's process starts one), first seen by its stdout, a `job.log` of the sweep, then followed by its session id:
    a process closes its stdout as it exits, and lives on a little."""

    def __init__(self, sweep_dir: Path) -> None:
        self.sweep_dir, self.sessions = sweep_dir, set[int]()

    def alive(self) -> set[int]:
        """The sessions of the jobs alive now (zombies are not)."""
        found = set()
        for pid, stat in _processes():
            if stat[0] != "Z" and (int(stat[3]) in self.sessions or self._logs(pid)):
                self.sessions.add(int(stat[3]))
                found.add(int(stat[3]))
        return found

    def _logs(self, pid: int) -> bool:
        try:
            out = os.readlink(f"/proc/{pid}/fd/1")
        except OSError:
            return False
        return out.startswith(f"{self.sweep_dir}/") and out.endswith("/job.log")

    @contextmanager
    def sampled(self) -> Iterator[list[int]]:
        """Samples how many jobs are alive, every 0.2 s while the block runs; yields the list of samples."""
        samples: list[int] = []
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.2):
                samples.append(len(self.alive()))

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield samples
        finally:
            done.set()
            thread.join()


def fork_server(sweeper: subprocess.Popen) -> int | None:
    """The pid of the sweeper's fork server of warm jobs, if it runs."""
    for pid, stat in _processes():
        if int(stat[1]) == sweeper.pid and stat[0] != "Z":
            try:
                if b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except OSError:
                continue
    return None


def trained(run_dir: Path) -> Callable[[], bool]:
    return lambda: (run_dir / "metrics.jsonl").exists() and bool(read_metrics(run_dir, "train"))


def statuses(sweep_dir: Path) -> list[str]:
    return [job["status"] for job in json.loads((sweep_dir / "sweep_summary.json").read_text())["jobs"]]


def test_a_fork_server_killed_at_start_up_leaves_the_job_to_a_fresh_process(tmp_path: Path) -> None:
    """The server is killed while it imports torch, with the launcher waiting for it to fork job 0 (its `queued`
    record gone): once an EOFError traceback; now job 0 starts fresh, with one warning."""
    sweep = tmp_path / "sweep"
    proc = start_sweep(["lr=1e-3", "train.max_steps=2"], sweep, {})

    server: list[int] = []

    def launcher_waits() -> bool:
        """The fork server runs, and the launcher waits for it to fork job 0 (its `queued` record is gone)."""
        if (sweep / "0").is_dir() and not (sweep / "0" / "job_status.json").exists():
            server.extend(pid for pid in [fork_server(proc)] if pid)
        return bool(server)

    jobs = JobWatch(sweep)
    with jobs.sampled() as samples:
        _wait_for(launcher_waits, "the launcher to wait for the fork server", proc)
        os.kill(server[0], signal.SIGKILL)
        code = proc.wait(timeout=300)
        left = jobs.alive()
    log = sweep_log(sweep)
    assert code == 0, log[-3000:]
    assert log.count("jobs start fresh processes: the fork server of warm jobs died before it started job #0") == 1
    assert "Traceback" not in log and "#0 started (pid " in log and ", CPU, warm)" not in log
    assert statuses(sweep) == ["completed"]
    assert max(samples, default=0) <= 1 and not left


def test_a_fork_server_killed_mid_job_leaves_its_jobs_watched_and_stopped_before_the_sweep_exits(
        tmp_path: Path) -> None:
    """Two slots, three paced jobs (3, 30, 30 steps). The server is killed while jobs 0 and 1 train: once both were
    counted failed (exit 255) at once, job 2 started beside them, and on Ctrl-C the sweep exited with job 1
    training on. Now job 0 ends by itself and is counted so, job 2 starts fresh in its slot, and Ctrl-C stops
    jobs 1 and 2 with a checkpoint before the sweep exits 1; the same command then resumes them."""
    sweep = tmp_path / "sweep"
    args = ["lr=1e-3", "train.max_steps=3,30,30", "cluster.max_parallel=2", "train.save_steps=0"]
    proc = start_sweep(args, sweep, paced_env(1.5))
    jobs = JobWatch(sweep)
    with jobs.sampled() as samples:
        _wait_for(lambda: trained(sweep / "0")() and trained(sweep / "1")(), "jobs 0 and 1 to train", proc)
        server = fork_server(proc)
        assert server is not None
        os.kill(server, signal.SIGKILL)
        _wait_for(trained(sweep / "2"), "job 2 to train", proc)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        code = proc.wait(timeout=300)
        left = jobs.alive()  # the sweep exited: no job may run on
    log = sweep_log(sweep)
    assert code == 1, log[-3000:]
    assert not left, f"job processes outlived the sweep: sessions {left}"
    assert max(samples) <= 2, f"more jobs alive at once than cluster.max_parallel=2: {max(samples)}"
    assert "the fork server of warm jobs died; job #" in log and "#2 started (pid " in log
    assert ", CPU, warm): " not in log.split("#2 started")[1].splitlines()[0]  # started fresh
    assert statuses(sweep) == ["completed", "preempted", "preempted"]
    for job in ("1", "2"):
        assert json.loads((sweep / job / "summary.json").read_text())["status"] == "preempted"

    again = run_cli(["--multirun", *TINY, *args, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=ENV)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert len(read_metrics(sweep / "0", "start")) == 1  # not run again
    for job in ("1", "2"):
        assert read_metrics(sweep / job, "resume")  # resumed from the checkpoint of its stop
    assert statuses(sweep) == ["completed"] * 3


def test_ctrl_c_as_a_search_trial_ends_stops_the_search_and_a_rerun_continues_it(tmp_path: Path) -> None:
    """Ctrl-C lands as trial 0's process has ended: once the search went on (the launcher took the interrupt for
    its own and found no trial left to stop), or ended in a traceback. Now it stops there with exit 1, the study's
    journal whole, and the same command continues it."""
    from optuna.trial import TrialState

    sweep = tmp_path / "search"
    args = ["sweep=random", "sweep.seed=0", "sweep.n_trials=2", "sweep.pruner=none", "train.max_steps=3",
            "lr=tag(log,interval(1e-4,1e-2))"]
    proc = start_sweep(args, sweep, {})
    trial_0 = JobWatch(sweep / "0")  # (from its summary on: it then writes its report, and exits)
    _wait_for(lambda: (sweep / "0" / "summary.json").exists() and not trial_0.alive(), "trial 0's end", proc)
    os.killpg(proc.pid, signal.SIGINT)
    code = proc.wait(timeout=300)
    log = sweep_log(sweep)
    assert code == 1, log[-3000:]
    assert "Traceback" not in log and "interrupted" in log
    assert not (sweep / "1" / "metrics.jsonl").exists()  # trial 1 never trained
    first = _study(sweep).get_trials()  # the journal replays: trial 0 told, unless Ctrl-C landed as it was read
    assert [t.number for t in first] in ([0], [0, 1]) and first[0].state in (TrialState.COMPLETE, TrialState.RUNNING)

    again = run_cli(["--multirun", *TINY, *args, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=ENV)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    trials = _study(sweep).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert len(read_metrics(sweep / "0", "start")) == 1  # trial 0 was not run again
