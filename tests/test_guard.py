"""The anomaly policies with real training: stop, skip (weights untouched) and rollback (recovers).

The bad step is planted by making the loss of one training forward infinite: a fault we inject
(a real inf in a batch cannot come from token ids), everything around it is the real trainer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmexp.model.loss import CausalLMLoss
from llmexp.train.train import train
from tests.conftest import TINY, compose, read_metrics

COMMON = [*TINY, "scheduler=constant", "train.warmup_steps=0", "lr=3e-3", "train.eval_steps=100",
          "precision=fp32"]


@pytest.fixture
def plant_inf(monkeypatch: pytest.MonkeyPatch):
    """Make the loss of the training forward number `at` (0-based) infinite."""
    def arm(at: int) -> None:
        original = CausalLMLoss.forward
        calls = {"n": 0}

        def forward(self: CausalLMLoss, *args, **kwargs) -> torch.Tensor:
            out = original(self, *args, **kwargs)
            if self.training:
                calls["n"] += 1
                if calls["n"] - 1 == at:
                    return out * math.inf
            return out

        monkeypatch.setattr(CausalLMLoss, "forward", forward)
    return arm


def test_stop_ends_the_run_as_diverged_at_the_bad_step(tmp_path: Path, plant_inf) -> None:
    plant_inf(3)
    result = train(compose([*COMMON, "train.on_anomaly=stop", "train.max_steps=10"], tmp_path / "stop"))
    assert result.status == "diverged" and result.step == 3
    assert result.summary["exit_code"] == 3
    anomalies = read_metrics(tmp_path / "stop", "anomaly")
    assert [a["step"] for a in anomalies] == [3] and anomalies[0]["action"] == "diverged"
    assert any(f["kind"] == "non_finite" and f["severity"] == "error" for f in result.summary["findings"])


def test_skip_leaves_the_weights_bitwise_unchanged(tmp_path: Path, plant_inf) -> None:
    clean = train(compose([*COMMON, "train.max_steps=5", "train.save_steps=0"], tmp_path / "clean"))
    plant_inf(5)  # the 6th and last step is the bad one
    skipped = train(compose([*COMMON, "train.on_anomaly=skip", "train.max_steps=6", "train.save_steps=0"],
                            tmp_path / "skip"))
    assert clean.status == skipped.status == "completed"
    assert skipped.summary["skipped_steps"] == 1
    before = load_file(str(tmp_path / "clean" / "model" / "model.safetensors"))
    after = load_file(str(tmp_path / "skip" / "model" / "model.safetensors"))
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


def test_rollback_restores_a_checkpoint_and_training_recovers(tmp_path: Path, plant_inf) -> None:
    plant_inf(6)
    run_dir = tmp_path / "rollback"
    result = train(compose([*COMMON, "train.on_anomaly=rollback", "train.max_steps=14", "train.save_steps=4",
                            "train.rollback_lr_factor=0.5"], run_dir))
    assert result.status == "completed" and result.step == 14
    assert result.summary["rollbacks"] == 1
    (event,) = read_metrics(run_dir, "rollback")
    assert event["step"] == 6 and event["to_step"] == 4 and event["lr_scale"] == 0.5
    losses = [r["loss"] for r in read_metrics(run_dir, "train")]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    lrs = [r["lr"] for r in read_metrics(run_dir, "train") if r["step"] > 6]
    assert lrs and all(lr == pytest.approx(1.5e-3) for lr in lrs)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_a_vetoed_fp16_step_leaves_the_loss_scaler_ready_for_the_next(policy: str, tmp_path: Path, plant_inf) -> None:
    """fp16's `clip` unscales the grads before the policy judges them; a vetoed step took no scaler update, and the
    next step's unscale_ raised "unscale_() has already been called on this optimizer" (exit 1)."""
    plant_inf(3)
    fp16 = [o for o in COMMON if not o.startswith("precision=")] + ["precision=fp16"]
    result = train(compose([*fp16, f"train.on_anomaly={policy}", "train.max_steps=8", "train.save_steps=2"],
                           tmp_path))
    assert result.status == "completed" and result.step == 8
    assert [a["step"] for a in read_metrics(tmp_path, "anomaly")] == [3]
