"""`lr=find`: the range test's curve and pick, and training after it bitwise equal to a plain run at that lr."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest

from llmexp.train.lr_find import smooth, suggest
from tests.conftest import TINY, compose, read_metrics, run_cli

BASE = [*TINY, "precision=fp32", "train.max_steps=4", "train.eval_steps=2", "train.save_steps=0",
        "train.peak_tflops=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`lr=find` (with demo-task evals) and a plain run at the lr it picked (no tasks), in this process."""
    from llmexp.train.train import train

    root = tmp_path_factory.mktemp("lr_find")
    found = train(compose([*BASE, "lr=find", "train.lr_find_steps=12", "eval=demo", "eval.demo_items=4"],
                          root / "find"))
    picked = json.loads((root / "find" / "lr_find.json").read_text())
    plain = train(compose([*BASE, f"lr={picked['suggestion']!r}"], root / "plain"))
    return {"root": root, "found": found, "plain": plain, "picked": picked}


def _weights(run_dir: Path) -> str:
    return hashlib.sha256((run_dir / "model" / "model.safetensors").read_bytes()).hexdigest()


def test_training_after_the_finder_is_bitwise_a_plain_run_at_its_lr(runs: dict[str, Any]) -> None:
    """The finder leaves no trace in the RNG, the data order or the weights; the demo task's evals none either."""
    find_dir, plain_dir = runs["root"] / "find", runs["root"] / "plain"
    assert runs["found"].status == runs["plain"].status == "completed"
    steps = lambda d: [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in read_metrics(d, "train")]  # noqa: E731
    evals = lambda d: [(r["step"], r["eval_loss"]) for r in read_metrics(d, "eval")]  # noqa: E731
    assert steps(find_dir) == steps(plain_dir) and len(steps(find_dir)) == 4
    assert evals(find_dir) == evals(plain_dir)
    assert _weights(find_dir) == _weights(plain_dir)
    summary = json.loads((find_dir / "summary.json").read_text())
    assert summary["lr"] == runs["picked"]["suggestion"] and summary["lr_source"] == "find"
    assert json.loads((plain_dir / "summary.json").read_text())["lr_source"] == "config"
    assert read_metrics(find_dir, "start")[0]["lr_source"] == "find"


def test_the_range_test_writes_its_curve_and_its_pick(runs: dict[str, Any]) -> None:
    picked, find_dir = runs["picked"], runs["root"] / "find"
    curve = picked["curve"]
    assert 3 <= picked["steps_run"] == len(curve) <= 12
    assert curve[0]["lr"] == pytest.approx(1e-7)
    ratios = [b["lr"] / a["lr"] for a, b in itertools.pairwise(curve)]
    assert all(r == pytest.approx(10 ** (8 / 11)) for r in ratios)  # exponential from 1e-7 to 10 over 12 steps
    assert picked["rule"] == "steep" and set(picked["picks"]) == {"minimum", "steep", "valley"}
    assert picked["suggestion"] == picked["picks"]["steep"] <= picked["lr_min_loss"]  # the steepest fall is before
    assert picked["picks"]["minimum"] == pytest.approx(picked["lr_min_loss"] / 10)
    assert [c["smoothed"] for c in curve] == pytest.approx(smooth([c["loss"] for c in curve]))
    assert (find_dir / "lr_find.png").stat().st_size > 5_000


def test_lr_find_only_stops_after_the_range_test(tmp_path: Path) -> None:
    from llmexp.train.train import train

    run_dir = tmp_path / "only"
    result = train(compose([*BASE, "lr=find", "train.lr_find_only=true", "train.lr_find_steps=6"], run_dir))
    assert result.status == "completed" and result.step == 0 and result.summary["steps_run"] >= 3
    assert (run_dir / "lr_find.json").is_file() and not (run_dir / "model").exists()
    assert not (run_dir / "metrics.jsonl").exists()


def test_a_rerun_reads_lr_find_json_unless_the_rule_changed(tmp_path: Path) -> None:
    """A resume or requeue reads the earlier test's result; another `train.lr_find_rule` tests again."""
    from llmexp.train.train import train

    run_dir, only = tmp_path / "only", [*BASE, "lr=find", "train.lr_find_only=true", "train.lr_find_steps=6"]
    train(compose(only, run_dir))
    first = (run_dir / "lr_find.json").read_bytes()
    (run_dir / "lr_find.json").write_text(json.dumps({**json.loads(first), "suggestion": 1e-6}))  # a marker
    assert train(compose(only, run_dir)).summary["suggestion"] == 1e-6  # read, not tested again
    again = train(compose([*only, "train.lr_find_rule=minimum"], run_dir)).summary
    assert again["rule"] == "minimum" and again["suggestion"] == pytest.approx(again["lr_min_loss"] / 10)


def test_each_rule_reads_its_pick_off_the_same_curve() -> None:
    lrs = [10 ** (-6 + i / 2) for i in range(12)]
    # a fall from index 1 to 7 with a bump at 3 (noise the valley rule must see past), then the divergence
    smoothed = [5.0, 5.1, 4.9, 4.95, 4.0, 3.0, 2.6, 2.4, 2.9, 4.0, math.inf, math.nan]
    got = suggest(lrs, smoothed, "valley")
    assert got["lr_min_loss"] == lrs[7] and got["picks"]["minimum"] == pytest.approx(lrs[7] / 10)
    assert got["picks"]["steep"] == lrs[4]  # 4.0 -> 3.0 is the largest drop per half decade
    assert got["picks"]["valley"] == lrs[3]  # the longest fall: 0, 2, 4, 5, 6, 7 (the bumps skipped); half-way 3
    assert got["suggestion"] == got["picks"]["valley"] and got["rule"] == "valley"
    assert suggest(lrs, smoothed, "minimum")["suggestion"] == pytest.approx(lrs[7] / 10)


def test_a_curve_that_never_falls_picks_within_it() -> None:
    """A rising curve (the first lr already too high): every rule still names an lr of the test, none past it."""
    lrs = [10 ** (-3 + i / 2) for i in range(6)]
    got = suggest(lrs, [2.0, 2.5, 3.0, 4.0, 6.0, 9.0], "steep")
    assert got["picks"] == {"minimum": pytest.approx(lrs[0] / 10), "steep": lrs[0], "valley": lrs[0]}


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.lr_find_only=true"], "train.lr_find_only"),
    (["lr=find", "train.lr_find_start=1", "train.lr_find_end=0.5"], "train.lr_find_end"),
    (["lr=find", "batch_size=auto"], "batch_size"),
    (["lr=find", "fsdp=full_shard"], "fsdp"),
    (["lr=find", "train.lr_find_steps=2"], "train.lr_find_steps"),
])
def test_bad_lr_find_settings_name_the_key(overrides: list[str], message: str, tmp_path: Path) -> None:
    from llmexp.config.validation import ConfigError, validate

    with pytest.raises(ConfigError, match=message):
        validate(compose(overrides, tmp_path))


@pytest.mark.parametrize("given", ["lr=3", "lr=auto", "++lr=1e-3"])
def test_lr_find_given_an_lr_says_it_picks_one_itself(given: str, tmp_path: Path) -> None:
    """`python -m llmexp.lr_find lr=3`: the command picks the lr, so the message says to drop it or train with it
    (not to use `python -m llmexp.lr_find`, which the user is doing); nothing is written."""
    proc = run_cli([given, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, module="llmexp.lr_find",
                   timeout_s=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{given}: python -m llmexp.lr_find picks the lr itself" in proc.stderr
    assert f"drop {given} to find one, or train with it: python -m llmexp {given}" in proc.stderr
    assert "use python -m llmexp.lr_find" not in proc.stderr
    assert list(tmp_path.iterdir()) == []
