"""Samples while training (`train.sample_prompts`): logged, shown, reported, and training unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from llmexp.config.validation import ConfigError, validate
from tests.conftest import TINY, compose, read_metrics

RUN = [*TINY, "precision=fp32", "lr=3e-3", "train.max_steps=6", "train.eval_steps=3", "train.save_steps=0"]
PROMPTS = ["train.sample_prompts=['def main(', 'import os']", "train.sample_steps=3",
           "train.sample_max_new_tokens=8", "train.sample_temperature=0.8", "train.sample_seed=7"]


def _run(tmp_path: Path, name: str, extra: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[Path, str]:
    """One run in this process (`train(cfg)`, as the CLI calls it; a fresh process would add ~8 s of imports
    a run), with what it printed."""
    from llmexp.train.train import train

    run_dir = tmp_path / name
    capfd.readouterr()
    assert train(compose([*RUN, *extra], run_dir)).status == "completed"
    printed = capfd.readouterr()
    return run_dir, printed.out + printed.err


@pytest.mark.slow
def test_samples_are_logged_shown_reported_and_leave_training_bitwise_unchanged(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    plain_dir, _ = _run(tmp_path, "plain", [], capfd)
    sampled_dir, console = _run(tmp_path, "sampled", PROMPTS, capfd)  # temperature > 0: sampling draws random numbers
    losses = lambda d: [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(d, "train")]  # noqa: E731
    assert losses(sampled_dir) == losses(plain_dir)  # the same floats: sampling touched no RNG training uses
    events = read_metrics(sampled_dir, "sample")
    assert [e["step"] for e in events] == [0, 3, 6]
    assert all([s["prompt"] for s in e["samples"]] == ["def main(", "import os"] for e in events)
    assert all(isinstance(s["completion"], str) and s["completion"] for e in events for s in e["samples"])
    assert "sample    0 | 'def main(' ->" in console
    report = (sampled_dir / "report.md").read_text()
    assert "## Samples" in report and "| prompt | step 0 | step 6 |" in report
    assert "## Samples" not in (plain_dir / "report.md").read_text()


def test_a_prompt_longer_than_the_context_keeps_its_end(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """As a generate task's: the model saw more positions than it has, and transformers warned of exceptions."""
    from llmexp.train.train import train

    prompt = "import os " * 60
    cfg = compose([*TINY, "precision=fp32", "train.max_steps=1", "train.save_steps=0", "train.sample_max_new_tokens=4",
                   f"train.sample_prompts=['{prompt}']"], tmp_path / "run")
    capfd.readouterr()
    assert train(cfg).status == "completed"
    printed = capfd.readouterr()
    assert "maximum length" not in printed.out + printed.err
    assert [s["prompt"] for e in read_metrics(tmp_path / "run", "sample") for s in e["samples"]] == [prompt]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"train": {"sample_max_new_tokens": 0}}, "train.sample_max_new_tokens"),
    ({"train": {"sample_temperature": -1.0}}, "train.sample_temperature"),
    ({"train": {"sample_prompts": ["x"]}, "deepspeed": {"stage": 3}}, "train.sample_prompts"),
])
def test_bad_sample_settings_name_the_key(overrides: dict, message: str) -> None:
    from hydra import compose, initialize_config_dir

    from llmexp.config.schema import register_configs
    from llmexp.config.tree import conf_dir

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config")
    cfg = OmegaConf.merge(cfg, OmegaConf.create(overrides))
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
