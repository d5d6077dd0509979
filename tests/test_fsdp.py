"""FSDP2 (`fsdp=...`) and resuming on another number of processes, on CPU with gloo.

The end-to-end tests save with N processes and resume with M: the losses after the resume must be
those the N processes computed uninterrupted (the sampler cuts the same global batch for any world
size, so an M-process run is the same run), and metrics.jsonl and summary.json say which world sizes
were involved. DCP's `.metadata` is read without running pickle code: a crafted one is refused with
exit 2 and its code never runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmexp.checkpoint.serialize import CorruptCheckpoint
from llmexp.errors import UserError
from tests.conftest import TINY, read_metrics, run_cli

# 4 steps, a checkpoint after 2, eval only at the start and the end: the fewest that show a resume.
RUN = [*TINY, "precision=fp32", "lr=1e-3", "train.max_steps=4", "train.eval_steps=100", "train.save_steps=2",
       "train.peak_tflops=1", "train.warmup_steps=1", "train.global_batch_size=8"]


def _torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "llmexp", *RUN, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def _run(processes: int, args: list[str], run_dir: Path) -> None:
    args = [*args, f"hydra.run.dir={run_dir}"]
    result = _torchrun(args, run_dir.parent) if processes == 2 else run_cli([*RUN, *args])
    assert result.returncode == 0, result.stderr[-3000:]


def _losses_after_resume(run_dir: Path) -> dict[int, float]:
    records = read_metrics(run_dir)
    records = records[max(i for i, r in enumerate(records) if r["event"] == "resume"):]
    return {r["step"]: r["loss"] for r in records if r["event"] == "train"}


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}


def _resume_on(processes: int, saved_by: int, args: list[str], tmp_path: Path) -> tuple[Path, dict[int, float]]:
    """A run saved by `saved_by` processes, cut back to its step-2 checkpoint, resumed on `processes`; with the
    losses of its first, uninterrupted pass (which the resume drops from metrics.jsonl). A run of the same global
    batch on any number of processes is the same run (tests/test_distributed.py), so the resumed steps must repeat
    those losses: no second uninterrupted run is needed."""
    run_dir = tmp_path / f"resumed_{saved_by}to{processes}"
    _run(saved_by, args, run_dir)
    uninterrupted = _losses(run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_4")
    _run(processes, args, run_dir)
    (resume,) = read_metrics(run_dir, "resume")
    assert (resume["step"], resume["world_size"], resume["resumed_from_world_size"]) == (2, processes, saved_by)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["resumed_from_world_size"]) == (processes, saved_by)
    return run_dir, uninterrupted


def _assert_resumed_steps_repeat(run_dir: Path, uninterrupted: dict[int, float]) -> None:
    resumed = _losses_after_resume(run_dir)
    assert resumed.keys() == {3, 4}
    for step in resumed:
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5), step


@pytest.mark.slow
def test_ddp_saved_by_two_resumes_on_one(tmp_path: Path) -> None:
    _assert_resumed_steps_repeat(*_resume_on(1, 2, [], tmp_path))


@pytest.mark.slow
def test_fsdp_saved_by_one_resumes_on_two(tmp_path: Path) -> None:
    """full_shard on 1 process, resumed by 2 through DCP's resharding; then a crafted `.metadata`."""
    fsdp = ["fsdp=full_shard"]
    run_dir, uninterrupted = _resume_on(2, 1, fsdp, tmp_path)
    _assert_resumed_steps_repeat(run_dir, uninterrupted)
    step_2 = run_dir / "checkpoints" / "step_2"
    assert (step_2 / "dcp" / ".metadata").is_file() and not (step_2 / "model.safetensors").exists()

    # model/ holds the gathered weights (whole tensors, not one rank's shard), as safetensors.
    from safetensors.torch import load_file

    weights = load_file(run_dir / "model" / "model.safetensors")
    assert weights["model.embed_tokens.weight"].shape == (512, 64)

    # A `.metadata` that would run code when unpickled, with a manifest rewritten to match it.
    marker = tmp_path / "pwned"
    metadata = step_2 / "dcp" / ".metadata"
    metadata.write_bytes(pickle.dumps(_Exec(f"open({str(marker)!r}, 'w').close()")))
    _rewrite_manifest(step_2, "dcp/.metadata")
    result = run_cli([*RUN, *fsdp, f"hydra.run.dir={run_dir}", f"train.resume={step_2}"])
    assert result.returncode == 2, result.stderr[-3000:]
    assert "refused global builtins.exec" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists()


class _Exec:
    """Unpickles as exec(code): what a malicious checkpoint would carry."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import builtins

        return builtins.exec, (self.code,)


def _rewrite_manifest(checkpoint: Path, rel: str) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = (checkpoint / rel).read_bytes()
    manifest["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_metadata_unpickler_reads_dcp_and_refuses_code(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp_lib

    from llmexp.checkpoint import dcp

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    with pytest.warns(UserWarning, match="single process"):  # DCP without a process group: one process
        dcp_lib.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=tmp_path)
    keys = set(dcp.read_metadata(tmp_path).state_dict_metadata)
    assert "model.weight" in keys and "optimizer.param_groups.0.lr" in keys

    fresh = torch.nn.Linear(4, 4)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    state = {"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict()}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, tmp_path)  # through the safe reader and planner: tensors and plain values come back
    assert torch.equal(state["model"]["weight"], model.weight)
    assert state["optimizer"]["param_groups"][0]["lr"] == optimizer.param_groups[0]["lr"]

    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exec(f"open({str(marker)!r}, 'w').close()")))
    with pytest.raises(CorruptCheckpoint, match=r"\.metadata: cannot be loaded safely.*builtins\.exec"):
        dcp.read_metadata(tmp_path)
    assert not marker.exists()


def _saved_dcp(directory: Path) -> dict:
    """A one-process DCP checkpoint of a small model in `directory`; returns its state dict."""
    import torch
    import torch.distributed.checkpoint as dcp_lib

    model = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="single process"):
        dcp_lib.save({"model": model.state_dict()}, checkpoint_id=directory)
    return {"model": model.state_dict()}


def _point_storage_at(directory: Path, target: str) -> None:
    """Rewrite `.metadata` so that every tensor's bytes are read from `target` (as a crafted checkpoint would)."""
    import dataclasses

    from llmexp.checkpoint.dcp import MetadataUnpickler

    with open(directory / ".metadata", "rb") as f:
        metadata = MetadataUnpickler(f).load()
    metadata.storage_data = {index: dataclasses.replace(info, relative_path=target)
                             for index, info in metadata.storage_data.items()}
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlink"])
def test_dcp_storage_paths_stay_inside_the_checkpoint(where: str, tmp_path: Path) -> None:
    """A `.metadata` whose storage paths lead out of the checkpoint (an absolute path, `..`, a link) is refused
    before any tensor byte is read: the outside file holds valid shards, which the stock reader would load."""
    import torch

    from llmexp.checkpoint import dcp

    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    expected = _saved_dcp(ckpt)
    _saved_dcp(outside)  # other weights, in a directory the checkpoint must not reach
    (shard,) = [p.name for p in outside.glob("*.distcp")]
    target = {"absolute": str(outside / shard), "dotdot": f"../outside/{shard}", "symlink": "link.distcp"}[where]
    if where == "symlink":
        (ckpt / "link.distcp").symlink_to(outside / shard)
    _point_storage_at(ckpt, target)
    state = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
    with pytest.raises(CorruptCheckpoint, match="outside the checkpoint directory"):
        dcp.load(state, ckpt)
    assert all(not t.any() for t in state["model"].values())  # nothing was read into the model


def _cfg(*overrides: str):
    from llmexp.cli.estimate import compose

    return compose(list(overrides))


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["fsdp=full_shard", "deepspeed=zero2"], "both shard the model"),
    (["fsdp=shard_grad_op", "optimizer=adamw8bit"], "bitsandbytes #1403"),
    (["fsdp=full_shard", "precision=fp16"], "sharded loss scaler"),
    (["fsdp=hybrid_shard", "peft=lora"], "peft=lora with fsdp"),
    (["fsdp=full_shard", "train.on_anomaly=rollback"], "rollback is not supported under fsdp"),
    (["fsdp=full_shard", "train.sample_prompts=[hi]"], "train.sample_prompts"),
    (["fsdp.cpu_offload=true"], "fsdp=none shards nothing"),
    (["fsdp.name=zero"], "fsdp.name"),
])
def test_fsdp_combinations_name_the_conflict(overrides: list[str], fragment: str) -> None:
    with pytest.raises(UserError, match=fragment):  # composing validates, as the CLI does
        _cfg(*overrides)


def test_fsdp_with_deepspeed_exits_2() -> None:
    result = run_cli([*TINY, "fsdp=full_shard", "deepspeed=zero2", "train.max_steps=2"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "deepspeed" in result.stderr and "Traceback" not in result.stderr


def test_zero_refuses_another_world_size_by_name() -> None:
    """The rule itself, on a stand-in runtime: a 2-process DeepSpeed run on CPU would build DeepSpeed's
    CPU ops (minutes) to reach the same check, which runs before anything is loaded."""
    from llmexp.train.engines.deepspeed import DeepSpeedEngine
    from llmexp.train.engines.plain import PlainEngine
    from llmexp.train.resume import _check_world_size

    lines: list[str] = []
    run = SimpleNamespace(engine=DeepSpeedEngine, desc=SimpleNamespace(plan=SimpleNamespace(world=2, global_batch=8)),
                          log=SimpleNamespace(write=lines.append))
    _check_world_size(run, 2)  # the same number: fine
    with pytest.raises(UserError, match=r"saved by 4 processes and cannot be resumed on 2.*DeepSpeed #2898.*fsdp"):
        _check_world_size(run, 4)
    run.engine = PlainEngine
    _check_world_size(run, 4)  # DDP: replicated state, resumes on any number
    assert "saved by 4 process(es) on 2" in lines[0]


def test_checkpoint_kinds_do_not_mix(tmp_path: Path) -> None:
    """A DDP checkpoint under fsdp, or an FSDP one (dcp/) under fsdp=none, exits 2 naming the option and the
    checkpoint, as its fit is checked, before anything is loaded (the engines on stand-in accelerators: nothing
    collective runs)."""
    from llmexp.config.derived import BatchPlan
    from llmexp.train.engines.fsdp import FsdpEngine
    from llmexp.train.engines.plain import PlainEngine
    from llmexp.train.resume import _check_fits

    plain = SimpleNamespace(engine=PlainEngine(SimpleNamespace(), "fp32", 1.0, 1))
    with pytest.raises(UserError, match=f"{tmp_path}: this checkpoint was saved with FSDP"):
        _check_fits(plain, tmp_path, {"dcp": tmp_path, "zero": None, "model": None, "optimizer": None})
    plan = BatchPlan(micro=4, accum=1, world=1, fixed_steps=4, epochs=1.0)
    fsdp = SimpleNamespace(engine=FsdpEngine(SimpleNamespace(), "fp32", plan, "full_shard", False))
    with pytest.raises(UserError, match="saved without FSDP"):
        _check_fits(fsdp, tmp_path, {"dcp": None, "zero": None, "model": {}, "optimizer": {}})
