"""The detectors on real runs: overfitting is found where it begins and early stopping fires;
clean runs of ten seeds raise no error-severity finding."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from llmexp.train.train import train
from tests.conftest import TINY, compose, read_metrics


def _text_file(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(300)]
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=60))}) + "\n" for _ in range(n)))
    return path


@pytest.mark.slow
def test_overfitting_is_found_and_early_stopping_fires(tmp_path: Path) -> None:
    train_file = _text_file(tmp_path / "train.jsonl", 6, seed=0)   # a tiny training set: memorised fast
    eval_file = _text_file(tmp_path / "eval.jsonl", 12, seed=1)
    run_dir = tmp_path / "overfit"
    result = train(compose([*TINY, "data=json", f"data.train_file={train_file}", f"data.eval_file={eval_file}",
                            "data.max_length=32", "lr=3e-3", "scheduler=constant", "train.warmup_steps=0",
                            "train.max_steps=400", "train.eval_steps=10", "train.save_steps=10",
                            "train.early_stopping_patience=3", "train.logging_steps=5"], run_dir))
    assert result.status == "early_stopped" and result.step < 400
    evals = read_metrics(run_dir, "eval")
    best = min(evals, key=lambda e: e["eval_loss"])
    (finding,) = [f for f in result.summary["findings"] if f["kind"] == "overfitting"]
    assert abs(finding["step"] - best["step"]) <= 10, (finding, best)
    assert "stop" in finding["advice"].lower() or "dropout" in finding["advice"].lower()
    # The best checkpoint survives rotation.
    assert (run_dir / "checkpoints" / f"step_{best['step']}").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_clean_short_runs_have_no_error_findings(seed: int, tmp_path: Path) -> None:
    result = train(compose([*TINY, f"seed={seed}", "train.max_steps=25", "train.eval_steps=10",
                            "train.save_steps=0", "lr=1e-3"], tmp_path / f"seed{seed}"))
    assert result.status == "completed"
    errors = [f for f in result.summary["findings"] if f["severity"] == "error"]
    assert not errors, errors
