"""`logger=mlflow` against a real MLflow tracking server (its SQLite backend, on loopback), read back through
`mlflow.MlflowClient`: params (secrets redacted), metric histories with every step once after a `kill -9` and a
resume, the findings as tags, the artifacts (and `model/` with `logger.log_model=true`), a 2-job sweep as a
parent run with two nested runs and the sweep report as the parent's artifacts. The server is started once
for the module and stopped by it. An unreachable server and the local store are tested on the sink itself,
without training; a bad URI through the CLI, which must exit 2 before anything is written."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf

from llmexp.monitor.mlflow_sink import MlflowSink, flat_params
from llmexp.rundir.redact import REDACTED
from llmexp.rundir.tracking import read_mlflow_run
from tests.conftest import TINY, run_cli

CANARY = "canary-token-8d1f0c"
"""A secret in the environment (`LLMEXP_TEST_API_KEY`) that one config value holds: it must never reach MLflow."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mlflow server` on a free loopback port, SQLite backend, artifacts served by the server; stopped after."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job runner and its 7 consumers
    with open(root / "server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                                 f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
                                 "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # creating the schema and importing the app: ~35 s on 2 loaded cores
        while True:
            assert proc.poll() is None, (root / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, (root / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its uvicorn worker
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _sweep(sweep: Path, uri: str, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    args = [*TINY, "logger=mlflow", f"logger.tracking_uri={uri}", "logger.experiment=sweep", "logger.log_model=true",
            "lr=1e-3,3e-3", "train.max_steps=200", "train.save_steps=20", "train.eval_steps=100",
            "cluster.max_parallel=2",
            f"train.sample_prompts=['{CANARY}']", "train.sample_max_new_tokens=2", f"hydra.sweep.dir={sweep}"]
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "llmexp", "--multirun", *args], env=env, stdout=log,
                                stderr=subprocess.STDOUT)


def _kill_when_mlflow_is_past_the_checkpoint(client: MlflowClient, job: Path, proc: subprocess.Popen,
                                            log_path: Path) -> str:
    """SIGKILL the job's trainer once its first checkpoint exists and MLflow holds steps after it, so that the
    resume re-runs steps MLflow already has; the job's MLflow run id. (200 steps: on an idle machine the tiny
    model's steps take ~30 ms, and the sink sends every 2 s: fewer steps end before MLflow has any.)"""
    deadline = time.monotonic() + 400
    while not (any((job / "checkpoints").glob("step_*")) and (known := read_mlflow_run(job))  # (rotated: any)
               and max(_steps(client, known["run_id"], "train/loss") or [0]) >= 6):
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.3)
    os.kill(int((job / ".llmexp.lock").read_text().split()[0]), signal.SIGKILL)  # the trainer holds the lock
    return known["run_id"]


@pytest.mark.slow
def test_a_sweep_is_a_parent_run_and_a_killed_job_resumes_its_run_with_every_step_once(server: str,
                                                                                    tmp_path: Path) -> None:
    """Two jobs as nested runs of one parent; job 0 is killed with SIGKILL past a checkpoint (the sweep ends
    with it `killed`), and the same command again resumes it into the same MLflow run under the same parent."""
    client, sweep = MlflowClient(server), tmp_path / "sweep"
    env = {**os.environ, "LLMEXP_TEST_API_KEY": CANARY}
    first = _sweep(sweep, server, env, tmp_path / "first.log")
    try:
        killed_id = _kill_when_mlflow_is_past_the_checkpoint(client, sweep / "0", first, tmp_path / "first.log")
    finally:
        first.wait(timeout=400)
    assert first.returncode == 1, (tmp_path / "first.log").read_text()[-3000:]  # job 0 was killed
    parent_id = read_mlflow_run(sweep)["run_id"]
    assert client.get_run(parent_id).info.status == "FAILED" and client.get_run(killed_id).info.status == "RUNNING"
    second = _sweep(sweep, server, env, tmp_path / "second.log")
    assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]

    assert read_mlflow_run(sweep)["run_id"] == parent_id and read_mlflow_run(sweep / "0")["run_id"] == killed_id
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.info.run_name == "sweep"
    report = {a.path for a in client.list_artifacts(parent_id)}
    assert {"sweep_report.md", "sweep_summary.json", "sweep_curves.png"} <= report
    runs = client.search_runs([parent.info.experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_id]
    assert len(runs) == 3 and sorted(r.info.run_name for r in children) == ["lr=0.001", "lr=0.003"]
    for child in children:
        job = Path(child.data.tags["llmexp.run_dir"])
        assert job.parent == sweep and read_mlflow_run(job)["run_id"] == child.info.run_id
        _check_run(client, child.info.run_id, job, tmp_path)
    assert sorted(float(r.data.params["lr"]) for r in children) == [1e-3, 3e-3]


def _check_run(client: MlflowClient, run_id: str, job: Path, tmp_path: Path) -> None:
    """One finished job's MLflow run against its run directory: every step once, params, tags, artifacts."""
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["llmexp.status"] == "completed"
    assert _steps(client, run_id, "train/loss") == list(range(1, 201))  # every step once, none lost or doubled
    assert _steps(client, run_id, "eval/eval_loss") == [0, 100, 200]
    losses = {r["step"]: r["loss"] for r in map(json.loads, (job / "metrics.jsonl").read_text().splitlines())
              if r["event"] == "train"}
    assert {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")} == pytest.approx(losses)
    params = run.data.params
    assert params["model.hidden_size"] == "64" and params["train.max_steps"] == "200"
    assert params["train.sample_prompts"] == json.dumps([REDACTED])
    assert CANARY not in json.dumps([params, run.data.tags])
    last = {f["kind"]: f for f in json.loads((job / "summary.json").read_text())["findings"]}
    for kind, finding in last.items():
        assert run.data.tags[f"finding.{kind}"].startswith(f"{finding['severity']} at step {finding['step']}: ")
    assert {"summary.json", "report.md", "curves.png", "model"} <= {a.path for a in client.list_artifacts(run_id)}
    assert {"model/config.json", "model/model.safetensors"} <= {a.path for a in client.list_artifacts(run_id, "model")}
    (tmp_path / run_id).mkdir()
    local = Path(client.download_artifacts(run_id, "summary.json", str(tmp_path / run_id)))
    assert json.loads(local.read_text())["step"] == 200


def _closed_port_uri() -> str:
    return f"http://127.0.0.1:{_free_port()}"  # nothing listens there: refused at once, like a server that is down


def test_an_unreachable_server_warns_once_and_a_resume_fills_the_local_run(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The sink itself, no training: a refused server gives one warning and the run's local SQLite store; a
    second attempt (a resume) continues that run, sends the checkpoint's steps it lacks and none twice."""
    lg = OmegaConf.create({"tracking_uri": _closed_port_uri(), "experiment": "offline", "init_timeout_s": 2.0,
                           "log_model": False})
    cfg = {"lr": 1e-3, "hub": {"api_key": CANARY}}
    history = [{"event": "train", "step": s, "loss": 10.0 - s} for s in range(1, 6)]
    with caplog.at_level(logging.WARNING, logger="llmexp.monitor.mlflow_sink"):
        first = MlflowSink(tmp_path, cfg, lg, "lr=1e-3")
        first.reset([])
        for record in history[:3]:  # steps 4 and 5 reach metrics.jsonl but not MLflow (a kill -9)
            first.log(record)
        (tmp_path / "summary.json").write_text(json.dumps({"status": "preempted", "findings": []}))
        first.close()
        warnings = [r.getMessage() for r in caplog.records if "could not reach" in r.getMessage()]
        assert len(warnings) == 1 and "logging to sqlite:///" in warnings[0] and "mlflow ui" in warnings[0]
        second = MlflowSink(tmp_path, cfg, lg, "lr=1e-3")
        second.reset(history)  # the checkpoint's history: steps 1-5
        second.log({"event": "train", "step": 6, "loss": 4.0})
        second.log({"event": "eval", "step": 6, "eval_loss": 4.5})
        (tmp_path / "summary.json").write_text(json.dumps({"status": "completed", "findings": []}))
        second.close()
    assert second.continued and second.run_id == first.run_id
    known = read_mlflow_run(tmp_path)
    assert known["tracking_uri"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(known["tracking_uri"])
    assert _steps(client, first.run_id, "train/loss") == [1, 2, 3, 4, 5, 6]
    assert client.get_run(first.run_id).info.status == "FINISHED"
    assert client.get_run(first.run_id).data.params["hub.api_key"] == REDACTED
    (tmp_path / "mlflow_run.json").unlink()  # a run that logged elsewhere (or not to MLflow) resumes here
    third = MlflowSink(tmp_path, cfg, lg, "lr=1e-3")
    third.reset(history)
    third.close()
    assert not third.continued and third.run_id != first.run_id
    assert _steps(client, third.run_id, "train/loss") == [1, 2, 3, 4, 5]  # the new run gets the whole history


def test_flat_params_are_dotted_json_and_bounded() -> None:
    params = flat_params({"model": {"hidden_size": 64, "name_or_path": None}, "tags": ["a", "b"], "kwargs": {},
                          "prompt": "x" * 7000, "flag": True})
    assert params == {"model.hidden_size": "64", "model.name_or_path": "null", "tags": '["a", "b"]', "kwargs": "{}",
                      "prompt": "x" * 5997 + "...", "flag": "true"}


@pytest.mark.parametrize(("uri", "expected"), [
    ("ftp://host/runs", "logger.tracking_uri=ftp://host/runs: ftp:// is not one of http, https, sqlite, databricks"),
    ("sqlite:////no/such/dir/mlflow.db", "logger.tracking_uri=sqlite:////no/such/dir/mlflow.db: no such directory"),
    ("sqlite:///{tmp}", "is not a file"),
    ("sqlite:///{tmp}/notes.txt", "notes.txt is not a SQLite database"),
])
def test_a_bad_tracking_uri_exits_2_before_anything_is_written(tmp_path: Path, uri: str, expected: str) -> None:
    (tmp_path / "notes.txt").write_text("not a database\n")
    uri = uri.format(tmp=tmp_path)
    proc = run_cli([*TINY, "logger=mlflow", f"logger.tracking_uri={uri}", f"hydra.run.dir={tmp_path / 'run'}"],
                   timeout_s=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_sweep_whose_parent_run_was_deleted_gets_a_new_one(tmp_path: Path) -> None:
    """The sweep directory records its parent run; deleted from the store meanwhile, a rerun of the sweep opens a
    new parent (its jobs nest under a live run) rather than failing to continue the deleted one."""
    from llmexp.monitor.mlflow_sink import client_for
    from llmexp.sweep.tracking import open_parent

    config = OmegaConf.create({"logger": {"name": "mlflow", "tracking_uri": None, "experiment": "sweep",
                                          "init_timeout_s": 10.0},
                               "train": {}, "hydra": {"overrides": {"task": ["lr=1e-3,2e-3"]}}})
    sweep = tmp_path / "sweep"
    open_parent(config, sweep)
    first = read_mlflow_run(sweep)
    client = client_for(first["tracking_uri"])
    open_parent(config, sweep)  # a rerun continues the same parent
    assert read_mlflow_run(sweep)["run_id"] == first["run_id"]
    client.delete_run(first["run_id"])
    open_parent(config, sweep)
    second = read_mlflow_run(sweep)
    assert second["run_id"] != first["run_id"]
    run = client.get_run(second["run_id"])
    assert run.info.lifecycle_stage == "active" and run.data.tags["llmexp.overrides"] == "lr=1e-3,2e-3"


def test_the_sends_after_connect_keep_the_http_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`connect`'s short limits (logger.init_timeout_s, no retries) end with it; the metric sends after it keep
    `HTTP_DEFAULTS` (30 s, 2 retries), not mlflow's own 120 s and 7 retries, which would stall a closing run."""
    from llmexp.monitor.mlflow_sink import HTTP_DEFAULTS, connect

    for name in HTTP_DEFAULTS:
        monkeypatch.setenv(name, "0")  # recorded, so the teardown removes what connect sets
        monkeypatch.delenv(name)
    connect(None, "defaults", tmp_path, timeout_s=5)
    assert {name: os.environ.get(name) for name in HTTP_DEFAULTS} == HTTP_DEFAULTS
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")  # the user's own setting wins, and survives connect
    connect(None, "defaults", tmp_path, timeout_s=5)
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "7"


def test_mlflows_own_log_lines_go_to_the_job_log_not_the_console(tmp_path: Path) -> None:
    """mlflow configured a handler of its own at import: its INFO lines (a new SQLite store's "Creating initial
    MLflow database tables") reached the console and missed llmexp.log, unlike every other library's."""
    proc = run_cli([*TINY, "logger=mlflow", "train.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mlflow.store" not in proc.stdout + proc.stderr
    assert "[mlflow.store.db.utils][INFO] - Creating initial MLflow database tables" in \
        (tmp_path / "run" / "llmexp.log").read_text()


def test_a_resume_with_another_experiment_logs_there(tmp_path: Path) -> None:
    """It went on in the first experiment (an empty "other" was created, the change only in a tag)."""
    history = [{"event": "train", "step": s, "loss": 10.0 - s} for s in range(1, 4)]
    runs = []
    for experiment in ("first", "other"):
        lg = OmegaConf.create({"tracking_uri": None, "experiment": experiment, "init_timeout_s": 10.0,
                               "log_model": False})
        sink = MlflowSink(tmp_path, {"lr": 1e-3}, lg, "lr=1e-3")
        sink.reset(history)
        (tmp_path / "summary.json").write_text(json.dumps({"status": "completed", "findings": []}))
        sink.close()
        runs.append(sink)
    assert not runs[1].continued and runs[1].run_id != runs[0].run_id
    client = MlflowClient(read_mlflow_run(tmp_path)["tracking_uri"])
    run = client.get_run(runs[1].run_id)
    assert client.get_experiment(run.info.experiment_id).name == "other"
    assert _steps(client, run.info.run_id, "train/loss") == [1, 2, 3]  # the whole history, in the new run
