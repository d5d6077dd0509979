"""wandb (offline, real wandb-core) and TensorBoard sinks: files written and read back; secrets never reach them."""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from llmexp.config.schema import LoggerConfig
from llmexp.errors import UserError
from llmexp.monitor.sinks import TensorBoardSink, WandbSink, run_name_from_overrides, wandb_mode
from llmexp.rundir.redact import REDACTED, is_secret_key, scrub
from tests.conftest import TINY, as_nobody

CANARY = "CANARY-7f3a9-do-not-leak"


def records() -> list[dict]:
    out: list[dict] = [{"event": "eval", "step": 0, "eval_loss": 9.0, "eval_ppl": math.exp(9.0)}]
    out += [{"event": "train", "step": s, "loss": 9.0 - 0.5 * s, "ppl": math.exp(9.0 - 0.5 * s), "lr": 1e-3,
             "grad_norm": 1.0 + 0.1 * s, "tokens_per_sec": 1000.0} for s in range(1, 6)]
    out += [{"event": "finding", "step": 5, "kind": "plateau", "severity": "info", "message": "m", "advice": "a"},
            {"event": "eval", "step": 5, "eval_loss": 6.5, "eval_ppl": math.exp(6.5)},
            {"event": "sample", "step": 5, "samples": [{"prompt": "def f(", "completion": "x): pass"}]}]
    return out


def test_scrub_redacts_secret_keys_and_values_only() -> None:
    cfg = {"lr": 1e-3, "model": {"num_key_value_heads": 2, "name_or_path": "x"},
           "data": {"tokenizer": "tok/", "max_length": 64},
           "hub": {"hf_token": CANARY, "api_key": CANARY, "wandb_api_key": CANARY, "db_password": CANARY,
                   "client_secret": CANARY, "token": CANARY, "empty_token": None},
           "notes": [f"hf_{'a' * 30}", "fine"]}
    clean = scrub(cfg)
    assert CANARY not in json.dumps(clean)
    assert clean["hub"]["hf_token"] == REDACTED and clean["hub"]["empty_token"] is None
    assert clean["model"] == cfg["model"] and clean["data"] == cfg["data"] and clean["lr"] == 1e-3
    assert clean["notes"] == [REDACTED, "fine"]
    assert not is_secret_key("pad_token") and not is_secret_key("max_length") and is_secret_key("HF_TOKEN")


def test_run_name_from_overrides() -> None:
    assert run_name_from_overrides([]) == "default"
    assert run_name_from_overrides(["lr=1e-3", "batch_size=4"]) == "lr=1e-3,batch_size=4"
    name = run_name_from_overrides(f"lr=1e-3,+hub.hf_token={CANARY},hydra.verbose=true")
    assert CANARY not in name and name.startswith("lr=1e-3,") and "hydra" not in name
    assert len(run_name_from_overrides(["x=" + "9" * 500])) <= 128


def test_wandb_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode("online") == "offline"


def read_wandb_log(path: Path) -> list:
    """Records of a .wandb file: wandb's LevelDB-style log (7-byte file header, 32 KiB blocks,
    records of checksum u32 / length u16 / type u8 chunks: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room for a header: the block is padded
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            pos += block - pos % block if pos % block else 0
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


@pytest.mark.parametrize("env_mode", [None, ""])  # an empty WANDB_MODE means unset (wandb itself rejects it)
def test_wandb_offline_run_is_readable_and_has_no_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          env_mode: str | None) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # no key: the sink must go offline, never prompt
    monkeypatch.delenv("WANDB_MODE", raising=False)
    if env_mode is not None:
        monkeypatch.setenv("WANDB_MODE", env_mode)
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    cfg = {"lr": 1e-3, "batch_size": 4, "model": {"hidden_size": 64}, "hub": {"hf_token": CANARY}}
    logger_cfg = LoggerConfig(name="wandb", project="llmexp-test", entity=None, mode="auto", tags=["ci"])
    sink = WandbSink(tmp_path, cfg, f"lr=1e-3,+hub.hf_token={CANARY}", logger_cfg)
    assert sink.mode == "offline"
    for record in records():
        sink.log(record)
    sink.close()
    run_dirs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1
    for f in run_dirs[0].rglob("*"):
        assert not f.is_file() or CANARY.encode() not in f.read_bytes(), f
    log = read_wandb_log(next(run_dirs[0].glob("run-*.wandb")))
    run = next(r.run for r in log if r.WhichOneof("record_type") == "run")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["lr"] == 1e-3 and config["hub"] == {"hf_token": REDACTED}
    assert CANARY not in run.display_name and run.display_name.startswith("lr=1e-3")
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in log if r.WhichOneof("record_type") == "history"]
    losses = {h["trainer/step"]: h["train/loss"] for h in history if "train/loss" in h}
    assert losses == {s: 9.0 - 0.5 * s for s in range(1, 6)}
    assert [h["eval/eval_loss"] for h in history if "eval/eval_loss" in h] == [9.0, 6.5]
    (table,) = [h for h in history if "samples/_type" in h]  # the sample event: a wandb table at step 5
    assert table["samples/_type"] == "table-file" and table["samples/nrows"] == 1 and table["trainer/step"] == 5
    (table_file,) = run_dirs[0].rglob("samples_*.table.json")
    assert json.loads(table_file.read_text())["data"] == [[5, "def f(", "x): pass"]]


def test_tensorboard_events_are_readable(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path)
    for record in [*records(), {"event": "train", "step": 6, "loss": float("nan"), "grad_norm": float("inf"),
                                "lr": 1e-3}]:
        sink.log(record)
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"train/loss", "train/grad_norm", "train/lr", "eval/eval_loss"} <= set(acc.Tags()["scalars"])
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss[:5] == [(s, pytest.approx(9.0 - 0.5 * s)) for s in range(1, 6)]
    assert loss[5][0] == 6 and math.isnan(loss[5][1])  # a NaN loss is logged, not dropped
    assert [e.value for e in acc.Scalars("eval/eval_loss")] == [9.0, 6.5]


def test_tensorboard_hparams_session_is_readable_and_replaced_on_resume(tmp_path: Path) -> None:
    """The HParams view's data, read back with tensorboard's own reader: the hyper-parameters given, those of
    the start record (resolved lr, batch, precision, optimizer), the final metrics; a resumed run's close
    replaces the earlier attempt's session rather than adding a second."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    start = {"event": "start", "step": 0, "lr_chosen": 3e-4, "batch_size": 8, "precision": "bf16",
             "optimizer": "lion"}
    for attempt, (status, loss) in enumerate([("preempted", 7.5), ("completed", 6.25)]):
        sink = TensorBoardSink(tmp_path, {"lr": "auto", "model.hidden_size": 64, "train.warmup_ratio": 0.1})
        for record in [start, *records()]:
            sink.log(record)
        (tmp_path / "summary.json").write_text(json.dumps({"status": status, "step": 5 + attempt, "eval_loss": loss,
                                                           "train_loss": 6.5, "eval_ppl": None}))
        sink.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "hparams"))
    acc.Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    assert metadata.EXPERIMENT_TAG in content
    info = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    values = {k: v.string_value or v.number_value for k, v in info.hparams.items()}
    assert values == {"lr": 3e-4, "model.hidden_size": 64, "train.warmup_ratio": 0.1, "batch_size": 8,
                      "precision": "bf16", "optimizer": "lion", "status": "completed"}
    assert [(e.step, e.value) for e in acc.Scalars("hparam/eval_loss")] == [(6, 6.25)]  # one session: the last
    assert set(acc.Tags()["scalars"]) == {"hparam/eval_loss", "hparam/train_loss"}  # eval_ppl: none to show


def _closed_port() -> int:
    """A loopback port nothing listens on: connections to it are refused at once, like a server that is down."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(180)  # wandb's own default would wait 90 s and then fail the run
def test_wandb_without_a_server_falls_back_to_offline(tmp_path: Path) -> None:
    """A real run with `logger=wandb`, an API key and no reachable server: it finishes, warns, and logs offline.

    Nothing is mocked; the unreachable server is `WANDB_BASE_URL` on a closed loopback port."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    env.update(WANDB_API_KEY="f" * 40, WANDB_BASE_URL=f"http://127.0.0.1:{_closed_port()}",
               WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "llmexp", *TINY, "logger=wandb", "logger.init_timeout_s=2",
                           "train.max_steps=2", "train.eval_steps=2", "train.save_steps=0",
                           f"hydra.run.dir={run_dir}"], env=env, capture_output=True, text=True, timeout=170)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "wandb could not start online within logger.init_timeout_s=2" in output and "Traceback" not in output
    assert "logging offline to" in output and "wandb sync" in output
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb")), list((run_dir / "wandb").iterdir())
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    # The real trainer fed the offline run its config, its name and its steps (this once had a run of its own,
    # tests/test_doctor_e2e.py's wandb test; the run above goes through the same trainer and sink).
    (run_file,) = offline[0].glob("run-*.wandb")
    log = read_wandb_log(run_file)
    run = next(r.run for r in log if r.WhichOneof("record_type") == "run")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["model"]["hidden_size"] == 64 and config["train"]["max_steps"] == 2
    assert "model.hidden_size=64" in run.display_name
    steps = [json.loads(i.value_json) for r in log if r.WhichOneof("record_type") == "history"
             for i in r.history.item if "/".join(i.nested_key) == "trainer/step" or i.key == "trainer/step"]
    assert 2 in steps


def test_a_tensorboard_path_that_cannot_take_event_files_is_named(tmp_path: Path) -> None:
    """Issue 40: a file where `tensorboard/` belongs, or a run directory this user cannot write, is a UserError
    naming the path and the fix (was a traceback)."""
    (tmp_path / "file" / "tensorboard").parent.mkdir()
    (tmp_path / "file" / "tensorboard").write_text("not a directory")
    with pytest.raises(UserError, match=r"file/tensorboard \(.*\); remove or rename"):
        TensorBoardSink(tmp_path / "file")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    tmp_path.chmod(0o755)
    with as_nobody(), pytest.raises(UserError, match=r"locked/tensorboard \(Permission denied\)"):
        TensorBoardSink(locked)
