"""`python -m llmexp.status DIR` on a real local sweep, watched while it runs and read after it ended, and the
TensorBoard HParams data the same sweep's jobs wrote (`logger=tensorboard`), read back with tensorboard's own
reader: one sweep of two jobs, run one after another, serves every test here. (On SLURM, tests/test_slurm.py
asks the status of a sweep while the local slurmctld runs it.)"""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from llmexp.report.status import rows
from tests.conftest import TINY, paced_env, run_cli

pytestmark = pytest.mark.slow
STEPS = 12
"""Each job's steps: enough for a poll to find job 0 between its first timed steps and its end."""
PAUSE_S = 0.2
"""Each step's pause (tests/pace): unpaced, a tiny step can take ~30 ms, and a loaded machine's poll then
missed job 0's whole window (~10 steps, seen once in CI); paced, the window is ~2 s long."""


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The sweep, and what its status said while job 0 trained and job 1 waited for the slot."""
    root = tmp_path_factory.mktemp("status")
    sweep_dir = root / "sweep"
    with open(root / "sweep.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "llmexp", "--multirun", *TINY, "logger=tensorboard",
                                 "lr=1e-3,3e-3", f"train.max_steps={STEPS}", f"train.eval_steps={STEPS}",
                                 "train.save_steps=0", f"hydra.sweep.dir={sweep_dir}"],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **paced_env(PAUSE_S)})
    seen: dict[str, Any] = {}
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if sweep_dir.is_dir() and not seen:
            table = {r.job: r for r in rows(sweep_dir)}
            first = table.get("0")
            if first and first.status == "running" and first.eta_s is not None and first.step and first.step < STEPS:
                seen = {"table": table, "cli": run_cli([str(sweep_dir)], module="llmexp.status", timeout_s=60)}
        time.sleep(0.1)
    assert proc.wait(timeout=60) == 0, (root / "sweep.log").read_text()[-3000:]
    return {"dir": sweep_dir, "running": seen, "root": root}


def test_a_running_sweep_shows_the_running_job_its_eta_and_the_queued_one(sweep: dict[str, Any]) -> None:
    assert sweep["running"], "never saw job 0 running with an ETA while job 1 waited"
    table = sweep["running"]["table"]
    assert set(table) == {"0", "1"} and table["1"].status == "queued" and table["1"].step is None
    assert table["0"].max_steps == STEPS and table["0"].loss is not None and table["0"].overrides == "lr=0.001"
    cli = sweep["running"]["cli"]
    assert cli.returncode == 0, cli.stderr
    assert "2 jobs (" in cli.stdout and " lr=0.003 " in cli.stdout


def test_an_ended_sweep_shows_every_job_and_its_final_metrics(sweep: dict[str, Any]) -> None:
    proc = run_cli([str(sweep["dir"])], module="llmexp.status", timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{sweep['dir']}: 2 jobs (2 completed)"
    assert lines[1].split() == ["job", "overrides", "status", "step", "loss", "eval", "best", "eta"]
    for line, job in zip(lines[2:], ("0", "1"), strict=True):
        summary = json.loads((sweep["dir"] / job / "summary.json").read_text())
        lr = "0.001" if job == "0" else "0.003"
        assert line.split() == [job, f"lr={lr}", "completed", f"{STEPS}/{STEPS}", f"{summary['train_loss']:.4g}",
                                f"{summary['eval_loss']:.4g}", f"{summary['best_eval_loss']:.4g}", "–"]


def test_the_status_never_imports_torch_or_a_tracker(sweep: dict[str, Any]) -> None:
    """What keeps the command quick on a busy login node (seconds of imports otherwise); its speed itself is not
    asserted here: a timed assert on a loaded machine measures the machine."""
    code = (f"import sys; from llmexp.report.status import main; assert main([{str(sweep['dir'])!r}]) == 0; "
            "print('HEAVY', [m for m in ('torch', 'mlflow', 'matplotlib', 'transformers') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "HEAVY []", proc.stdout


def test_a_run_directory_and_one_whose_process_is_gone(sweep: dict[str, Any], tmp_path: Path) -> None:
    (single,) = rows(sweep["dir"] / "0")
    assert single.status == "completed" and single.step == single.max_steps == STEPS and "lr=0.001" in single.overrides
    killed = tmp_path / "killed"
    shutil.copytree(sweep["dir"] / "0", killed)
    (killed / "summary.json").unlink()  # what a kill -9 leaves: metrics and no summary, no process
    (row,) = rows(killed)
    assert row.status == "killed" and row.step == STEPS and row.eta_s is None
    stopped = tmp_path / "stopped"  # a preemption saves at a step past the last logged one: summary.json says it
    shutil.copytree(sweep["dir"] / "0", stopped)
    summary = json.loads((stopped / "summary.json").read_text())
    (stopped / "summary.json").write_text(json.dumps({**summary, "status": "preempted", "step": STEPS + 5}))
    (row,) = rows(stopped)
    assert row.status == "preempted" and row.step == STEPS + 5
    (stopped / "summary.json").write_text('{"status": "compl')  # damaged: failed, as the sweep report says
    assert rows(stopped)[0].status == "failed"


def test_watch_redraws_the_table_in_place_until_ctrl_c(sweep: dict[str, Any]) -> None:
    def ignore_sigint() -> None:  # as a script's background job, or a pytest-xdist worker's child, starts
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "llmexp.status", str(sweep["dir"]), "--watch", "0.2"],
                            stdin=follower, stdout=follower, stderr=follower, env={**os.environ, "COLUMNS": "120"},
                            preexec_fn=ignore_sigint)
    os.close(follower)
    out, deadline = b"", time.monotonic() + 60
    while out.count(b"\x1b[H") < 3 and time.monotonic() < deadline:
        if select.select([leader], [], [], 0.5)[0]:
            out += os.read(leader, 65536)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    os.close(leader)
    text = out.decode()
    assert text.startswith("\x1b[2J\x1b[H") and text.count("\x1b[H") >= 3  # cleared once, then redrawn in place
    assert text.count("2 jobs (2 completed)") >= 3 and "every 0.2 s" in text


def test_not_a_run_or_sweep_directory_exits_2(tmp_path: Path) -> None:
    proc = run_cli([str(tmp_path)], module="llmexp.status", timeout_s=60)
    assert proc.returncode == 2 and "neither a run directory" in proc.stderr
    from llmexp.report.status import main

    with pytest.raises(SystemExit) as exit_info:  # (0 was taken as "not given" and redrew as fast as it could)
        main([str(tmp_path), "--watch", "0"])
    assert exit_info.value.code == 2


def test_each_job_wrote_its_hparams_for_tensorboard(sweep: dict[str, Any]) -> None:
    """`tensorboard --logdir SWEEP_DIR`'s HParams view: one session per job with the swept lr, the lr, batch,
    precision and optimizer it ran with, and its final metrics as in summary.json."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import metadata

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(sweep["dir"]))
    mux.Reload()
    sessions = {}
    for run, tags in mux.PluginRunToTagToContent(metadata.PLUGIN_NAME).items():
        if metadata.SESSION_START_INFO_TAG in tags:
            info = metadata.parse_session_start_info_plugin_data(tags[metadata.SESSION_START_INFO_TAG])
            sessions[run] = {k: v.string_value or v.number_value for k, v in info.hparams.items()}
    assert sorted(sessions) == ["0/tensorboard/hparams", "1/tensorboard/hparams"]
    for job, lr in (("0", 1e-3), ("1", 3e-3)):
        summary = json.loads((sweep["dir"] / job / "summary.json").read_text())
        assert sessions[f"{job}/tensorboard/hparams"] == {"lr": pytest.approx(lr), "batch_size": 4,
                                                          "precision": summary["precision"], "optimizer": "adamw",
                                                          "status": "completed"}
        scalars = {tag: mux.Scalars(f"{job}/tensorboard/hparams", tag)[-1].value
                   for tag in mux.GetAccumulator(f"{job}/tensorboard/hparams").Tags()["scalars"]}
        assert scalars["hparam/eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-6)
        assert scalars["hparam/best_eval_loss"] == pytest.approx(summary["best_eval_loss"], rel=1e-6)


@pytest.mark.parametrize(("state", "status"), [("PREEMPTED", "preempted"), ("CANCELLED by 1000", "cancelled"),
                                               ("TIMEOUT", "timeout"), ("OUT_OF_MEMORY", "failed"),
                                               ("RUNNING", None), ("COMPLETED", None)])
def test_one_table_names_how_slurm_ended_a_job(state: str, status: str | None) -> None:
    """The status table and the SLURM launcher's record read SLURM's end states alike; a job preempted by
    cancellation is `preempted` (a rerun resumes it), which the launcher once recorded as failed."""
    from llmexp.rundir.read import INTERRUPTED, slurm_end_status
    from llmexp.sweep.slurm import _final_status

    assert slurm_end_status(state) == status
    assert _final_status(state) == (status or "failed")
    assert (status in INTERRUPTED) == (state == "PREEMPTED" or state.startswith("CANCELLED"))
