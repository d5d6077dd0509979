"""DeepSpeed ZeRO through Accelerate's plugin, for real, on CPU (one process; DeepSpeed 0.19 runs
its ZeRO-2 and its CPU Adam here). Its ops are compiled once into a persistent cache
(~/.cache/llmexp/torch_extensions, or TORCH_EXTENSIONS_DIR): minutes the first time.

What must hold (for a muP model, whose parameter groups carry their own lrs): the engine's accumulation
and loss scaling agree with the loop's token-normalised loss (ZeRO-2 with accumulation gives the plain
run's losses), the loss falls, a checkpoint holds every rank's ZeRO shard loadable without pickle, and a
resumed run continues exactly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import TINY, read_metrics, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]

# muP at twice its base width: its parameter groups' own lrs (hidden matrices at lr / 2) must reach DeepSpeed's
# optimizer. A lost factor would show in the rel=1e-5 checks below: doubling every group's lr moves this plain
# run's step-6 loss by 1.1%.
RUN = [*TINY, "precision=fp32", "lr=1e-3", "train.max_steps=6", "train.eval_steps=3", "train.save_steps=3",
       "train.peak_tflops=1", "train.warmup_steps=1", "model.parametrization=mup", "model.mup_base_width=32"]


def _losses(run_dir: Path, after_resume: bool = False) -> dict[int, float]:
    records = read_metrics(run_dir)
    if after_resume:
        start = max(i for i, r in enumerate(records) if r["event"] == "resume")
        records = records[start:]
    return {r["step"]: r["loss"] for r in records if r["event"] == "train"}


def _run(args: list[str], run_dir: Path) -> None:
    result = run_cli([*RUN, *args, f"hydra.run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]


def _resume_from_step_3(args: list[str], run_dir: Path) -> dict[int, float]:
    """Drop the final checkpoint and rerun: the run resumes from step_3 and redoes steps 4-6."""
    shutil.rmtree(run_dir / "checkpoints" / "step_6")
    (run_dir / "summary.json").unlink()
    _run(args, run_dir)
    return _losses(run_dir, after_resume=True)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: no DeepSpeed, one process, batch 8, no accumulation."""
    run_dir = tmp_path_factory.mktemp("plain")
    _run(["batch_size=8"], run_dir)
    return run_dir


@pytest.fixture(scope="module")
def plain_losses(plain_run: Path) -> dict[int, float]:
    return _losses(plain_run)


def _assert_close(a: dict[int, float], b: dict[int, float], rel: float) -> None:
    assert a.keys() == b.keys()
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=rel), (step, a[step], b[step])


def test_zero2_compiled_with_accumulation_matches_plain_run_and_resumes(tmp_path: Path,
                                                               plain_losses: dict[int, float]) -> None:
    from llmexp.checkpoint.serialize import load_state

    # train.compile: the blocks are compiled in place, before the engine wraps the model, and train as eager ones
    args = ["deepspeed=zero2", "batch_size=4", "train.gradient_accumulation_steps=2", "train.compile=true"]
    _run(args, tmp_path)
    losses = _losses(tmp_path)
    # DeepSpeed divides by its accumulation steps unless told not to; the loop already normalised by tokens.
    _assert_close(losses, plain_losses, rel=1e-5)
    assert losses[6] < losses[1]
    ckpt = tmp_path / "checkpoints" / "step_3"
    assert (ckpt / "zero_rank0.pt").is_file() and not (ckpt / "optimizer.pt").exists()
    shard = load_state(ckpt / "zero_rank0.pt")  # weights_only=True: no pickle code runs
    assert shard["world_size"] == 1 and shard["zero"]["single_partition_of_fp32_groups"]
    assert "bias_correction" not in shard["zero"]["base_optimizer_state"]["param_groups"][0]  # torch AdamW
    resumed = _resume_from_step_3(args, tmp_path)
    _assert_close(resumed, {s: losses[s] for s in (4, 5, 6)}, rel=1e-6)


def test_zero2_offload_uses_cpu_adam_learns_and_resumes(tmp_path: Path, plain_run: Path,
                                                        plain_losses: dict[int, float]) -> None:
    from llmexp.checkpoint.serialize import load_state

    args = ["deepspeed=zero2_offload", "batch_size=8"]
    _run(args, tmp_path)
    losses = _losses(tmp_path)
    assert losses[6] < losses[1]
    # DeepSpeedCPUAdam is a different kernel than torch's AdamW: same maths, float-rounding apart.
    _assert_close(losses, plain_losses, rel=1e-4)
    shard = load_state(tmp_path / "checkpoints" / "step_3" / "zero_rank0.pt")
    # Accelerate swapped torch's AdamW for DeepSpeedCPUAdam (its param groups carry bias_correction).
    assert "bias_correction" in shard["zero"]["base_optimizer_state"]["param_groups"][0]
    assert shard["zero"]["clip_grad"] == 1.0  # train.max_grad_norm
    resumed = _resume_from_step_3(args, tmp_path)
    _assert_close(resumed, {s: losses[s] for s in (4, 5, 6)}, rel=1e-6)
    assert (tmp_path / "model" / "model.safetensors").is_file()
    step_3 = tmp_path / "checkpoints" / "step_3"  # without DeepSpeed: the engine's own refusal, unwrapped
    result = run_cli([*RUN, "batch_size=8", f"train.resume={step_3}", f"hydra.run.dir={tmp_path / 'plain'}"])
    assert result.returncode == 2 and f"{step_3}: this checkpoint was saved with DeepSpeed ZeRO" in result.stderr
    assert "passed its checks" not in result.stderr and "resume from an older one" not in result.stderr
    plain_3 = plain_run / "checkpoints" / "step_3"  # and the other way round (it said "parameter groups of sizes
    result = run_cli([*RUN, *args, f"train.resume={plain_3}", f"hydra.run.dir={tmp_path / 'zero'}"])  # ... do not fit")
    assert result.returncode == 2 and f"{plain_3}: this checkpoint was saved without DeepSpeed ZeRO" in result.stderr


def test_zero2_offload_runs_lion_on_deepspeeds_cpu_lion(tmp_path: Path) -> None:
    """optimizer=lion under optimizer offload: DeepSpeedCPULion, fed the muP groups' own lrs and Lion's betas, takes
    the steps bitsandbytes' Lion takes in a plain run (Accelerate's own mapping passed it Adam's `adamw_mode`: a
    TypeError as the run started)."""
    from llmexp.checkpoint.serialize import load_state

    _run(["optimizer=lion", "batch_size=8"], tmp_path / "plain")
    _run(["optimizer=lion", "batch_size=8", "deepspeed=zero2_offload"], tmp_path / "offload")
    losses = _losses(tmp_path / "offload")
    assert losses[6] < losses[1]
    # Lion's sign updates: a rounding flips a few (1.5e-4 apart); a group's lost lr moves the loss 1%
    _assert_close(losses, _losses(tmp_path / "plain"), rel=1e-3)
    shard = load_state(tmp_path / "offload" / "checkpoints" / "step_3" / "zero_rank0.pt")
    group = shard["zero"]["base_optimizer_state"]["param_groups"][0]
    assert "bias_correction" not in group and tuple(group["betas"]) == (0.9, 0.99)  # not DeepSpeedCPUAdam; Lion's
