"""`cluster=slurm` on a real single-node SLURM (launch/slurm-local.sh) with the real trainer.

Covers: a 3-job lr sweep as one job array; a sweep where one job raises and one is scancel'd
(every job still gets an entry, the command exits non-zero); a job that reaches its time limit,
checkpoints on SIGUSR2, is requeued and ends with the same loss curve as an uninterrupted run, step by
step the points of submitit's requeue protocol (its own `test_requeuing_checkpointable`, in the wheel).
Jobs run with OMP_NUM_THREADS=1 so that two share the two cores without fighting and the
reference run computes with the same thread count as the SLURM job.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import submitit

from llmexp.sweep.slurm import SlurmJob
from tests.conftest import REPO, TINY, paced_env, slurm_reachable

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# PYTHONPATH: the SLURM jobs import this checkout, ahead of any installed llmexp.
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
QUICK = ["train.eval_steps=100000", "train.save_steps=0"]


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster() -> None:
    """The local cluster; started with launch/slurm-local.sh when sinfo cannot reach one."""
    if not slurm_reachable():
        pytest.skip("no SLURM cluster: run `sudo bash launch/slurm-local.sh up`")


def start_sweep(tmp_path: Path, name: str, args: list[str],
                env: dict[str, str] = ENV) -> tuple[subprocess.Popen, Path, Path]:
    sweep, log_path = tmp_path / name, tmp_path / f"{name}.log"
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "llmexp", "--multirun", "cluster=slurm", *TINY, *args,
                                 f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env={**os.environ, **env},
                                stdout=log, stderr=subprocess.STDOUT)
    return proc, sweep, log_path


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> train loss; a step logged twice (before a kill and again after resume) keeps the last."""
    losses = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["event"] == "train":
            losses[record["step"]] = record["loss"]
    return losses


def events(run_dir: Path, name: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == name]


def status_table(sweep: Path) -> dict[str, list[str]]:
    """`python -m llmexp.status SWEEP`'s rows by job: overrides, status, step, loss, eval, best, eta, SLURM id
    and state (squeue and sacct may take longer than the default 0.7 s while the node is loaded). At 200 columns,
    so that no override is cut short (pytest-xdist's workers set COLUMNS=80)."""
    proc = subprocess.run([sys.executable, "-m", "llmexp.status", str(sweep), "--scheduler-timeout", "10"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **ENV, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].split() == ["job", "overrides", "status", "step", "loss", "eval", "best", "eta", "slurm"], lines
    return {line.split()[0]: line.split()[1:] for line in lines[2:]}


def test_lr_sweep_completes_as_one_job_array(tmp_path: Path) -> None:
    marks = tmp_path / "setup_ran"
    setup = f"cluster.setup=['mkdir -p {marks}', 'touch {marks}/$SLURM_ARRAY_TASK_ID']"
    proc, sweep, log = start_sweep(tmp_path, "lr", ["lr=1e-3,3e-3,1e-2", "train.max_steps=5", *QUICK, setup])
    assert proc.wait(timeout=400) == 0, log.read_text()[-3000:]
    assert sorted(p.name for p in marks.iterdir()) == ["0", "1", "2"]  # cluster.setup ran on the node, per job
    ids = json.loads((sweep / "slurm_jobs.json").read_text())["jobs"]
    array_id = ids["0"].split("_")[0]
    assert ids == {str(i): f"{array_id}_{i}" for i in range(3)}  # one array, all submitted at once
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert [j["status"] for j in summary["jobs"]] == ["completed"] * 3
    assert [float(j["params"]["lr"]) for j in summary["jobs"]] == [1e-3, 3e-3, 1e-2]
    assert summary["recommendation"] is not None
    for job in range(3):
        assert json.loads((sweep / str(job) / "summary.json").read_text())["step"] == 5
        assert (sweep / ".submitit" / ids[str(job)] / f"{ids[str(job)]}_0_result.pkl").exists()


def test_a_sweep_sbatch_refuses_exits_2_leaving_no_job_and_a_corrected_one_runs_there(tmp_path: Path) -> None:
    """An unknown partition: sbatch refuses the array, so the sweep exits 2 with sbatch's reason and no traceback
    (it raised submitit's FailedJobError), and no job directory says `submitted` (each did, forever); so the
    corrected command may use the same sweep directory (it found "a job of another sweep" there)."""
    proc, sweep, log = start_sweep(tmp_path, "refused", ["cluster.partition=no_such_partition", "lr=1e-3,2e-3"])
    assert proc.wait(timeout=120) == 2, log.read_text()[-3000:]
    text = log.read_text()
    assert "sbatch submitted none of the 2 jobs" in text and "Invalid partition" in text, text[-3000:]
    assert "Traceback" not in text and not sweep.exists()  # (its .submitit/, multirun.yaml: status said "missing")
    proc, _, log = start_sweep(tmp_path, "unknown", ["+cluster.additional_parameters.foo=bar", "lr=1e-3"])
    assert proc.wait(timeout=120) == 2 and "(sbatch: unrecognized option '--foo=bar')" in log.read_text(), \
        log.read_text()[-3000:]  # (it quoted the `Try "sbatch --help"` line after it)
    # corrected, and not waited for (cluster.wait=false): submitted is a success (it exited 1, "did not end by
    # themselves", pointing at a sweep_report.md not written)
    proc, sweep, log = start_sweep(tmp_path, "refused", ["lr=1e-3", "train.max_steps=1", *QUICK, "cluster.wait=false"])
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert "Submitted SLURM jobs" in log.read_text() and "have not ended" not in log.read_text()
    wait_for(lambda: (sweep / "0" / "summary.json").exists(), "the job submitted without waiting")
    assert json.loads((sweep / "0" / "summary.json").read_text())["step"] == 1


def test_two_task_jobs_train_as_one_distributed_job(tmp_path: Path) -> None:
    # The trainer runs on both tasks, as ranks 0 and 1, with the torch.distributed env from SLURM's.
    proc, sweep, log = start_sweep(tmp_path, "tasks", ["lr=1e-3,3e-3", "train.max_steps=5",
                                                        "cluster.tasks_per_node=2", *QUICK])
    assert proc.wait(timeout=400) == 0, log.read_text()[-3000:]
    ids = json.loads((sweep / "slurm_jobs.json").read_text())["jobs"]
    for job in range(2):
        assert events(sweep / str(job), "start")[0]["global_batch_size"] == 2 * 4  # world size 2 x batch_size 4
        assert len(list((sweep / ".submitit" / ids[str(job)]).glob("*_result.pkl"))) == 2  # both ranks ended


def test_a_raising_and_a_cancelled_job_are_recorded_and_the_others_complete(tmp_path: Path) -> None:
    # job 0 trains, job 1 fails on its own config (a negative eps that only torch refuses, when the optimizer
    # is built: a user error inside the job; `optimizer.eps=-1.0` would be refused before the sweep launches),
    # job 2 is scancel'd while training.
    proc, sweep, log = start_sweep(tmp_path, "faults", ["+optimizer.kwargs.eps=1e-8,-1.0,1e-7",
                                                        "train.max_steps=300", *QUICK])
    wait_for(lambda: (sweep / "slurm_jobs.json").exists() or proc.poll() is not None, "submission", 120)
    victim = json.loads((sweep / "slurm_jobs.json").read_text())["jobs"]["2"]
    metrics = sweep / "2" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count('"train"') >= 3, "job 2 to train")
    running = status_table(sweep)  # llmexp.status while the sweep runs: the files and squeue/sacct
    assert sorted(running) == ["0", "1", "2"]
    assert running["2"][0].startswith("+optimizer.kwargs.eps=") and running["2"][1] == "running", running
    assert running["2"][2].endswith("/300") and running["2"][6] != "–" and running["2"][7:] == [victim, "RUNNING"]
    subprocess.run(["scancel", victim], check=True)
    assert proc.wait(timeout=300) == 1, log.read_text()[-3000:]  # a failed job, not a user's mistake (2)
    ended = status_table(sweep)  # each job's own word, even while SLURM still tidies up after it
    assert [ended[j][1] for j in ("0", "1", "2")] == ["completed", "failed", "cancelled"], ended
    assert ended["0"][2] == "300/300"
    wait_for(lambda: [row[8] for row in status_table(sweep).values()] == ["COMPLETED", "COMPLETED", "CANCELLED"],
             "sacct's final states in the status", 120)
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs[:2]] == ["completed", "failed"]
    assert "optimizer.kwargs" in jobs[1]["error"]  # the job's own message, from job_status.json
    cancelled = json.loads((sweep / "2" / "job_status.json").read_text())
    assert cancelled["status"] == "cancelled" and cancelled["job_id"] == victim
    # The trainer checkpointed on SIGTERM, so its summary.json says `preempted`; the sweep entry
    # must still say that SLURM cancelled it.
    assert jobs[2]["status"] == "cancelled", jobs[2]
    assert any((sweep / "2" / "checkpoints").glob("step_*")), "the trainer did not checkpoint on SIGTERM"


PACED = {**ENV, **paced_env(0.15)}
"""The timeout test's processes: every optimizer step followed by a 150 ms pause (tests/pace/sitecustomize.py).
A tiny step computes for ~35 ms on one idle core, ~70 ms on a loaded one: paced, a step takes 185-220 ms
whatever else the machine runs, and the minutes the job must train to reach SLURM's limit cost ~1/6 of the CPU."""


def steps_per_second(tmp_path: Path) -> float:
    """This machine's speed for the timeout test's work, measured now (one thread and paced, as the jobs run)."""
    run_dir = tmp_path / "calibrate"
    subprocess.run([sys.executable, "-m", "llmexp", *TINY, "lr=3e-3", "train.max_steps=120", "train.logging_steps=1",
                    *QUICK, f"hydra.run.dir={run_dir}"], cwd=tmp_path, env={**os.environ, **PACED}, check=True,
                   capture_output=True, timeout=600)
    times = {r["step"]: r["time_s"] for r in events(run_dir, "train")}
    return 100 / (times[120] - times[20])


@dataclass
class TimeoutSweep:
    """The timeout test's sweep of one job and its uninterrupted reference run, both running in the background
    (tests/conftest.py starts them ahead of the test, `timeout_sweep`)."""

    proc: subprocess.Popen
    sweep: Path
    log: Path
    reference: subprocess.Popen
    reference_dir: Path
    num_steps: int

    def stop(self) -> None:
        """Whatever still runs (a failed test's leftovers): the processes, and the SLURM job itself."""
        for proc in (self.proc, self.reference):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        ids = self.sweep / "slurm_jobs.json"
        if ids.exists():
            subprocess.run(["scancel", *json.loads(ids.read_text())["jobs"].values()], check=False, timeout=60)


def start_timeout_sweep(tmp_path: Path) -> TimeoutSweep:
    # SLURM sends SIGUSR2 30 s before the 2-minute limit, checking every 30 s: 60-90 s into an attempt,
    # which leaves ~45-80 s of training after start-up. The run is sized from this machine's measured
    # speed to need ~120 s of training, so the first attempt is always cut; paced (PACED), the job's speed
    # stays within ~20% of the measured one whatever else the machine runs, which leaves 2-4 attempts, and
    # cluster.max_num_timeout=6 room for 7 (tests/test_submitit_protocol.py checks running out).
    num_steps = int(min(5000, max(300, 120 * steps_per_second(tmp_path))))
    args = ["lr=3e-3", f"train.max_steps={num_steps}", "train.logging_steps=1", *QUICK]
    ref_dir = tmp_path / "reference"
    with open(tmp_path / "reference.log", "w") as ref_log:
        reference = subprocess.Popen([sys.executable, "-m", "llmexp", *TINY, *args, f"hydra.run.dir={ref_dir}"],
                                     cwd=tmp_path, env={**os.environ, **PACED}, stdout=ref_log,
                                     stderr=subprocess.STDOUT)
    proc, sweep, log = start_sweep(tmp_path, "timeout", [*args, "cluster.timeout_min=2", "cluster.signal_delay_s=30",
                                                         "cluster.max_num_timeout=6"], env=PACED)
    return TimeoutSweep(proc, sweep, log, reference, ref_dir, num_steps)


def test_timeout_checkpoints_requeues_and_resumes_exactly(timeout_sweep: TimeoutSweep) -> None:
    run = timeout_sweep
    assert run.proc.wait(timeout=1200) == 0, run.log.read_text()[-3000:]
    assert run.reference.wait(timeout=300) == 0
    assert_requeue_protocol(run.sweep, max_num_timeout=6)
    resumed, uninterrupted = train_losses(run.sweep / "0"), train_losses(run.reference_dir)
    assert sorted(resumed) == list(range(1, run.num_steps + 1))
    assert resumed == uninterrupted  # bitwise: the same floats at every step


LLMEXP_CAUGHT = "llmexp: SIGUSR2: saving a checkpoint at the next step boundary, then stopping"
SUBMITIT_CAUGHT = re.compile(r"Caught signal SIGUSR2 on .*: this job is timed-out\.")
REQUEUED = re.compile(r"Requeued job (\S+) \((\d+) remaining timeouts\)")


def assert_requeue_protocol(sweep: Path, max_num_timeout: int) -> None:
    """The timed-out job 0 of `sweep` went through submitit's requeue protocol, llmexp's handler beside submitit's:

    1. at each SIGUSR2, llmexp's PreemptionSignal caught it first (its line in the job's stderr) and the
       trainer checkpointed; only then did submitit's handler see it, called by llmexp's SlurmJob, and count
       a timeout (submitit counts any signal in a 2-minute job as one);
    2. submitit called SlurmJob.checkpoint() and requeued the same SLURM job (`scontrol requeue`: one job
       id, which slurmctld's accounting shows REQUEUED once per attempt), its countdown one lower each time;
    3. its pickled submission is now SlurmJob.checkpoint()'s: the same job, with `train.resume=auto` and the
       countdown left, and each attempt after the first resumed from the checkpoint the one before wrote;
    4. the last attempt ended the job with one result, `completed`.
    """
    job, ids = sweep / "0", json.loads((sweep / "slurm_jobs.json").read_text())["jobs"]
    job_id = ids["0"]
    folder = sweep / ".submitit" / job_id
    assert [p.name for p in (sweep / ".submitit").iterdir() if p.is_dir()] == [job_id]  # requeued, not resubmitted
    err = (folder / f"{job_id}_0_log.err").read_text()  # SLURM appends each attempt's output
    out = (folder / f"{job_id}_0_log.out").read_text()
    requeues = REQUEUED.findall(out)
    attempts = len(requeues) + 1
    assert requeues, "the job was never requeued"
    assert requeues == [(job_id, str(max_num_timeout - n)) for n in range(1, attempts)], requeues
    # 1: in each interrupted attempt, llmexp's handler first, then submitit's. The last attempt may end inside
    # SLURM's warning window too: llmexp then catches the signal as the run completes, and completed it stays
    # (a warning after the outcome is final is ignored), so submitit never sees it
    ours = [m.start() for m in re.finditer(re.escape(LLMEXP_CAUGHT), err)]
    theirs = [m.start() for m in SUBMITIT_CAUGHT.finditer(err)]
    assert len(theirs) == attempts - 1 and len(ours) in (attempts - 1, attempts), err[-3000:]
    assert all(a < b for a, b in zip(ours, theirs, strict=False)), err[-3000:]
    assert all(b < a for a, b in zip(ours[1:], theirs, strict=False)), err[-3000:]  # one attempt after another
    if len(ours) == attempts:
        assert "completed: " in err[ours[-1]:], err[-3000:]
    # 2: slurmctld saw one job requeued, not new jobs (its accounting may lag the job's end by seconds)
    def accounting() -> list[str]:
        return subprocess.run(["sacct", "-n", "-X", "-D", "-j", job_id, "-o", "State"], capture_output=True,
                              text=True, timeout=60, check=True).stdout.split()
    wait_for(lambda: accounting()[-1:] == ["COMPLETED"], "the accounting of the job's end", timeout_s=120)
    assert accounting() == ["REQUEUED"] * (attempts - 1) + ["COMPLETED"], accounting()
    # 3: the submission is the checkpoint's, and each attempt resumed from the one before
    delayed = submitit.helpers.DelayedSubmission.load(folder / f"{job_id}_submitted.pkl")
    assert isinstance(delayed.function, SlurmJob) and delayed.function.spec.config.train.resume == "auto"
    assert delayed._timeout_countdown == max_num_timeout - (attempts - 1)
    resumes = events(job, "resume")
    assert len(resumes) == attempts - 1, resumes
    for resume in resumes:  # train.save_steps=0: the only checkpoints are those the signals made
        assert Path(resume["checkpoint"]).parent == job / "checkpoints"  # its own run directory's
        assert Path(resume["checkpoint"]).name == f"step_{resume['step']}" and resume["step"] > 0
    assert [r["step"] for r in resumes] == sorted({r["step"] for r in resumes})  # each attempt got further
    # 4: one result, written by the last attempt
    assert [p.name for p in folder.glob("*_result.pkl")] == [f"{job_id}_0_result.pkl"]
    outcome, result = submitit.core.utils.pickle_load(folder / f"{job_id}_0_result.pkl")
    assert outcome == "success" and result["status"] == "completed", (outcome, result)
    assert json.loads((job / "summary.json").read_text())["status"] == "completed"


def test_a_tpe_asha_search_prunes_on_slurm_and_a_rerun_extends_it(tmp_path: Path) -> None:
    """Issue #17: 6 trials of tpe + asha, 2 at a time as job arrays; each trial reports its evals to the study
    in the sweep directory from its node and the ones ASHA condemns stop with a checkpoint. The same
    command with sweep.n_trials=7 then runs one more trial, and none of the first six again."""
    from optuna.trial import TrialState

    from llmexp.rundir.study import load_study

    search = ["sweep=tpe", "sweep.parallel=2", "sweep.pruner=asha", "lr=tag(log,interval(1e-5,1e-1))",
              "train.max_steps=12", "train.eval_steps=3", "train.save_steps=0", "precision=fp32"]
    proc, sweep, log = start_sweep(tmp_path, "tpe", [*search, "sweep.n_trials=6"])
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    trials = load_study(sweep).get_trials()
    assert len(trials) == 6 and all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    assert pruned, [(t.params, t.intermediate_values) for t in trials]
    for trial in pruned:
        summary = json.loads((sweep / str(trial.number) / "summary.json").read_text())
        assert summary["status"] == "pruned" and summary["step"] == max(trial.intermediate_values) < 12
        assert (sweep / str(trial.number) / "checkpoints" / f"step_{summary['step']}").is_dir()
    assert sorted(json.loads((sweep / "slurm_jobs.json").read_text())["jobs"], key=int) == [str(n) for n in range(6)]

    proc, _, log = start_sweep(tmp_path, "tpe", [*search, "sweep.n_trials=7"])
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    trials = load_study(sweep).get_trials()
    assert len(trials) == 7 and trials[6].state in (TrialState.COMPLETE, TrialState.PRUNED)
    assert all(len(events(sweep / str(n), "start")) == 1 for n in range(6))  # not run again
    assert (sweep / "sweep_report.md").exists()
