"""`batch_size=auto`: the candidates, the config rules, and real tiny runs that probe, log the choice and keep it
on resume (the resumed run probes nothing and continues with the same micro-batch and losses)."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmexp.cli.estimate import compose as compose_checked
from llmexp.config.derived import auto_batch_candidates, make_plan
from llmexp.config.validation import ConfigError, validate
from tests.conftest import TINY, compose, read_metrics


def _train_cfg(global_batch: int | None) -> SimpleNamespace:
    return SimpleNamespace(train=SimpleNamespace(global_batch_size=global_batch))


@pytest.mark.parametrize(("global_batch", "world", "examples", "expected"), [
    (None, 1, 0, [1024, 768, 512, 384, 256, 192, 128, 96, 64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1]),  # the cap only
    (None, 2, 60, [24, 16, 12, 8, 6, 4, 3, 2, 1]),                  # 30 examples per process: 24 the largest below
    (24, 2, 0, [12, 6, 4, 3, 2, 1]),                                # divisors of the 12 per process
    (16, 1, 5, [4, 2, 1]),                                          # both caps: a divisor of 16 within 5 examples
    (7, 1, 0, [7, 1]),                                              # a prime share: itself or 1
])
def test_candidates_step_by_at_most_3_4_and_respect_the_global_batch_and_the_data(
        global_batch: int | None, world: int, examples: int, expected: list[int]) -> None:
    got = auto_batch_candidates(_train_cfg(global_batch), world, examples)
    assert got == expected
    assert all(b <= a * 3 // 4 for a, b in itertools.pairwise(got))  # never a step of less than 4/3
    if global_batch is not None:
        assert all(global_batch // world % m == 0 for m in got)


@pytest.mark.parametrize(("value", "says"), [("0", "batch_size: must be >= 1 (or auto), got 0; e.g. batch_size=4"),
                                             ("big", "batch_size=big: must be an integer or auto"),
                                             ("2.5", "batch_size=2.5: must be an integer or auto")])
def test_a_bad_batch_size_names_the_key_and_the_fix(value: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose_checked([f"batch_size={value}"])
    assert says in str(err.value)


def test_auto_is_refused_with_deepspeed_and_plans_with_accumulation_from_the_global_batch() -> None:
    with pytest.raises(ConfigError, match="batch_size=auto does not work with deepspeed=zero2"):
        compose_checked(["batch_size=auto", "deepspeed=zero2"])
    cfg = compose_checked(["batch_size=auto", "train.global_batch_size=32"])
    validate(cfg)
    plan = make_plan(cfg, 2, micro=4)
    assert (plan.micro, plan.accum, plan.global_batch) == (4, 4, 32)


def test_a_global_batch_and_accumulation_set_to_disagree_are_refused_naming_both_and_either_alone_plans() -> None:
    from llmexp.errors import UserError

    both = compose_checked(["batch_size=4", "train.global_batch_size=64", "train.gradient_accumulation_steps=4"])
    with pytest.raises(UserError) as err:
        make_plan(both, 1)
    assert str(err.value) == (
        "train.global_batch_size=64 and train.gradient_accumulation_steps=4 disagree: batch_size x processes x "
        "accumulation = 4 x 1 x 4; set train.gradient_accumulation_steps=16 (or drop it), or "
        "train.global_batch_size=16")
    assert make_plan(both, 4).accum == 4  # 4 x 4 processes x 4 = 64: they agree
    for one, accum in ((["train.global_batch_size=64"], 16), (["train.gradient_accumulation_steps=4"], 4)):
        plan = make_plan(compose_checked(["batch_size=4", *one]), 1)
        assert (plan.accum, plan.global_batch) == (accum, 4 * accum)


def test_preflight_needs_a_global_batch_the_processes_divide(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmexp.machine.environment import _batch_errors

    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = compose_checked(["batch_size=auto", "train.global_batch_size=30"])
    assert "not a multiple of the 4 processes" in _batch_errors(cfg)[0]
    assert _batch_errors(compose_checked(["batch_size=auto", "train.global_batch_size=32"])) == []


def test_estimate_cli_prints_the_upper_bound_for_auto(capsys: pytest.CaptureFixture[str]) -> None:
    from llmexp.cli.estimate import main

    assert main(["batch_size=auto", "train.global_batch_size=64"]) == 0
    assert "batch_size=auto: up to 64 per device by this estimate" in capsys.readouterr().out


AUTO = [*TINY, "batch_size=auto", "train.global_batch_size=8", "train.max_steps=4", "train.save_steps=2",
        "train.eval_steps=100", "train.peak_tflops=1.0", "logger=jsonl"]


@pytest.mark.slow  # two tiny runs in-process: ~10 s, more on a loaded machine
def test_auto_probes_logs_the_choice_and_a_resume_keeps_it_without_probing(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from llmexp.train import autobatch
    from llmexp.train.train import train

    probes: list[int] = []
    real_probe = autobatch._probe

    def counting_probe(cfg, rt, vocab_size, micro, budget):  # a spy: the real probe runs
        probes.append(micro)
        return real_probe(cfg, rt, vocab_size, micro, budget)

    monkeypatch.setattr(autobatch, "_probe", counting_probe)
    run_dir = tmp_path / "run"
    assert train(compose(AUTO, run_dir)).status == "completed"
    start = read_metrics(run_dir, "start")[-1]
    chosen = start["batch_size_auto"]
    # the global batch per process (8) caps the search; the estimate allows it and the probe confirms it
    assert probes == [8] and chosen["chosen"] == chosen["upper_bound"] == 8 == start["batch_size"]
    # on CPU the peak is the RSS growth over the probe step: 0 when the step fit in memory the process already
    # held (an xdist worker, warm from earlier tests), never negative
    assert chosen["probed"][0]["fits"] and chosen["probed"][0]["peak_mb"] >= 0
    assert start["gradient_accumulation_steps"] == 1 and start["global_batch_size"] == 8
    first = {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}
    assert "batch_size=auto: 8 per device" in (run_dir / "llmexp.log").read_text()

    # Resume from the step-2 checkpoint: the choice comes from its loop state.
    step_2 = run_dir / "checkpoints" / "step_2"
    assert step_2.is_dir()
    assert train(compose([*AUTO, f"train.resume={step_2}"], run_dir)).status == "completed"
    resumed = read_metrics(run_dir, "start")[-1]
    assert probes == [8], "the resumed run probed again"
    assert resumed["step"] == 2 and resumed["batch_size"] == 8
    assert resumed["batch_size_auto"]["source"] == "checkpoint"
    again = {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}
    assert again == first  # steps 3 and 4 retrained from the checkpoint: bitwise the same losses


def test_the_upper_bound_is_the_largest_candidate_whose_estimate_fits_the_budget() -> None:
    from llmexp.model.estimate import count_params_meta, estimate, largest_fitting

    cfg = compose_checked(["batch_size=auto", "precision=fp32"])
    facts = {"num_params": count_params_meta(cfg), "precision": "fp32", "world": 1}
    at_4 = estimate(cfg, micro_batch=4, **facts).total
    assert estimate(cfg, micro_batch=8, **facts).total > at_4  # activations grow with the micro-batch
    assert largest_fitting(cfg, [16, 8, 4, 2, 1], at_4 + 1, **facts) == 4
    assert largest_fitting(cfg, [16, 8, 4, 2, 1], 1.0, **facts) == 1  # none fits: the probe decides from 1
