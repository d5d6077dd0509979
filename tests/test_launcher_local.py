"""The local launcher (`cluster=local`): a process per job, bounded parallelism, GPU slots, crash isolation.

The sweeps run a throwaway Hydra app (tests/launcher_toy_app.py: llmexp's config tree and launchers,
a task that sleeps, raises or kills itself) through the real launcher, so each takes seconds.
There are no GPUs here: the GPU tests set CUDA_VISIBLE_DEVICES to fake ids, which the launcher
hands out per job while the toy task never touches CUDA; `device_slots` is also tested directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmexp.errors import UserError
from llmexp.sweep.local import child_env, device_slots, visible_gpus

APP = Path(__file__).with_name("launcher_toy_app.py")


def run_toy(sweep_dir: Path, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """The toy app's --multirun in a subprocess; returns the finished Popen (its pid is the launcher's)."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")}
    full_env.update(env or {})
    with open(sweep_dir.parent / f"{sweep_dir.name}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(APP), "--multirun", *args, f"hydra.sweep.dir={sweep_dir}"],
                                cwd=sweep_dir.parent, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        proc.wait(timeout=120)
    return proc


def toy_records(sweep_dir: Path, jobs: range) -> list[dict]:
    return [json.loads((sweep_dir / str(j) / "toy.json").read_text()) for j in jobs]


def max_overlap(records: list[dict]) -> int:
    """The most jobs that were running at the same moment."""
    return max(sum(1 for o in records if o["start"] <= r["start"] < o["end"]) for r in records)


def test_every_job_in_its_own_process_and_a_crash_or_kill_stops_no_other(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_toy(sweep, ["model.name=ok,raise,kill,ok", "lr=0.2", "cluster.max_parallel=2"])
    log = (tmp_path / "sweep.log").read_text()
    assert proc.returncode == 1, log
    ok = toy_records(sweep, range(0, 4, 3))
    assert {r["ppid"] for r in ok} == {proc.pid}  # children of the launcher...
    assert len({r["pid"] for r in ok}) == 2  # ...each in its own process
    failed = json.loads((sweep / "1" / "job_status.json").read_text())
    assert failed["status"] == "failed" and "RuntimeError: toy job failure" in failed["error"]
    assert failed["overrides"] == ["model.name=raise", "lr=0.2", "cluster.max_parallel=2"]
    killed = json.loads((sweep / "2" / "job_status.json").read_text())
    assert killed["status"] == "killed" and "SIGKILL" in killed["error"]
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert [j["status"] for j in summary["jobs"]] == ["completed", "failed", "killed", "completed"]
    assert "RuntimeError: toy job failure" in (sweep / "1" / "job.log").read_text()  # the child's traceback


def test_a_user_error_in_a_job_is_recorded_with_its_message(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_toy(sweep, ["model.name=usererror,ok", "lr=0.1"])
    assert proc.returncode == 1, (tmp_path / "sweep.log").read_text()
    status = json.loads((sweep / "0" / "job_status.json").read_text())
    assert status["exit_code"] == 2 and "data.train_file=/nowhere.jsonl does not exist" in status["error"]
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert "fix the path" in summary["jobs"][0]["error"] and summary["jobs"][1]["status"] == "completed"
    assert "data.train_file=/nowhere.jsonl" in (sweep / "sweep_report.md").read_text()


def test_a_mistake_every_job_hit_ends_the_sweep_with_exit_2(tmp_path: Path) -> None:
    """docs/reference/commands.md: a sweep exits 2 for a mistake every job would repeat; running the same command
    again would only repeat it, so the sweep says to fix it (one job's own mistake, above, is exit 1)."""
    sweep = tmp_path / "sweep"
    proc = run_toy(sweep, ["model.name=usererror", "lr=0.1,0.2"])
    log = (tmp_path / "sweep.log").read_text()
    assert proc.returncode == 2, log
    assert "every job stopped on a mistake in its config or data (exit 2): toy: data.train_file=" in log
    assert "runs them again" not in log
    assert [j["status"] for j in json.loads((sweep / "sweep_summary.json").read_text())["jobs"]] == ["failed"] * 2
    report = subprocess.run([sys.executable, "-m", "llmexp.report", str(sweep)], capture_output=True, text=True)
    assert report.returncode == 2, report.stderr  # the sweep's own code, read again from its directory


def test_cpu_jobs_run_serially_by_default_and_max_parallel_at_once(tmp_path: Path) -> None:
    serial = tmp_path / "serial"
    assert run_toy(serial, ["lr=0.5,0.5"]).returncode == 0
    assert max_overlap(toy_records(serial, range(2))) == 1
    parallel = tmp_path / "parallel"
    assert run_toy(parallel, ["lr=1.5,1.5,1.5,1.5", "cluster.max_parallel=2"]).returncode == 0
    records = toy_records(parallel, range(4))
    assert max_overlap(records) == 2
    assert {r["cuda"] for r in records} == {None}
    assert {r["omp"] for r in records} == {str(max(1, (os.cpu_count() or 1) // 2))}  # CPU shared fairly
    spelled = tmp_path / "spelled"  # the launcher's own spelling of cluster.max_parallel (issue 19)
    assert run_toy(spelled, ["lr=1.5,1.5", "hydra.launcher.max_parallel=2"]).returncode == 0
    assert max_overlap(toy_records(spelled, range(2))) == 2


def test_fake_gpus_one_job_per_gpu_and_queueing(tmp_path: Path) -> None:
    sweep = tmp_path / "gpus"
    proc = run_toy(sweep, ["lr=1.5,1.5,1.5", "cluster.max_parallel=1"], env={"CUDA_VISIBLE_DEVICES": "3,5"})
    assert proc.returncode == 0
    records = toy_records(sweep, range(3))
    assert {r["cuda"] for r in records} <= {"3", "5"}
    assert max_overlap(records) == 2  # both GPUs busy; max_parallel applies to CPU jobs only
    for a in records:
        for b in records:
            if a is not b and a["start"] <= b["start"] < a["end"]:
                assert a["cuda"] != b["cuda"], "two jobs shared a GPU with jobs_per_gpu=1"
    first_end = min(r["end"] for r in records[:2])
    assert records[2]["start"] >= first_end  # the third job waited for a free GPU


def test_device_slots() -> None:
    assert device_slots(["0", "1"], jobs_per_gpu=1, max_parallel=8) == ["0", "1"]
    assert device_slots(["0", "1"], jobs_per_gpu=2, max_parallel=1) == ["0", "1", "0", "1"]
    assert device_slots(["GPU-a1"], jobs_per_gpu=3, max_parallel=1) == ["GPU-a1"] * 3
    assert device_slots([], jobs_per_gpu=4, max_parallel=3) == [None, None, None]
    with pytest.raises(UserError, match=r"hydra\.launcher\.max_parallel=0"):  # any Hydra app's spelling
        device_slots([], jobs_per_gpu=1, max_parallel=0)
    with pytest.raises(UserError, match=r"cluster\.jobs_per_gpu=0"):  # llmexp's
        device_slots(["0"], jobs_per_gpu=0, max_parallel=1, prefix="cluster.")


def test_visible_gpus_and_child_env() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0, 2,5"}) == ["0", "2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert child_env("2", 4, base={"CUDA_VISIBLE_DEVICES": "0,1,2"})["CUDA_VISIBLE_DEVICES"] == "2"
    assert "OMP_NUM_THREADS" not in child_env(None, 1, base={})
    assert child_env(None, 2, base={"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"  # the user's choice wins


def test_a_bad_cluster_setting_is_one_message_and_exit_2(tmp_path: Path) -> None:
    sweep = tmp_path / "bad"
    proc = run_toy(sweep, ["lr=0.1,0.2", "cluster.max_parallel=0"])
    log = (tmp_path / "bad.log").read_text()
    assert proc.returncode == 2, log
    assert "cluster.max_parallel=0" in log and "Traceback" not in log
    assert not list(sweep.glob("*/toy.json"))  # nothing ran


@pytest.mark.slow  # one tiny llmexp job
def test_llmexp_jobs_start_fresh_where_the_fork_server_of_warm_jobs_cannot_start(tmp_path: Path) -> None:
    """On CPU llmexp's jobs are forked from a preloaded server (tests/test_headline.py checks that they are); under
    Python < 3.13 its socket lives under TMPDIR, and a TMPDIR too long for an AF_UNIX path kept the sweep from
    starting any job (the GPU kit's tiny run found it). The jobs then start as fresh processes, with a warning."""
    from tests.conftest import TINY, run_cli

    long_tmp = tmp_path / ("t" * 120)
    long_tmp.mkdir()
    proc = run_cli(["--multirun", "lr=1e-3", "train.max_steps=2", *TINY, f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                   cwd=tmp_path, env={"TMPDIR": str(long_tmp)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "jobs start fresh processes: the fork server of warm jobs did not start" in proc.stdout
    assert ", CPU): " in proc.stdout and ", CPU, warm)" not in proc.stdout
    summary = json.loads((tmp_path / "sweep" / "sweep_summary.json").read_text())
    assert [j["status"] for j in summary["jobs"]] == ["completed"]


def test_the_launcher_refuses_another_sweeps_directory_before_it_writes(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The second guard, behind the CLI's (`check_sweep`): no job pickles left in the other sweep's directory."""
    from types import SimpleNamespace

    from hydra_plugins.llmexp_launcher.llmexp_launcher import LocalLauncherConf
    from llmexp.sweep import local
    from llmexp.sweep.jobs import JobSpec

    job_dir = tmp_path / "sweep" / "0"
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text("- lr=0.005\n")  # another sweep's job #0
    before = sorted(tmp_path.rglob("*"))
    monkeypatch.setattr(local, "compose_jobs", lambda *_: [JobSpec(0, ["lr=0.001"], None, job_dir)])
    monkeypatch.setattr(local, "is_llmexp_config", lambda _: True)
    launcher = SimpleNamespace(settings=LocalLauncherConf(), config=None, task_function=None, hydra_context=None)
    with pytest.raises(UserError, match="holds a job of another sweep"):
        local.launch_local(launcher, [["lr=0.001"]], 0)
    assert sorted(tmp_path.rglob("*")) == before
