"""Config composition and validation: every group option composes, mistakes exit 2 naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from llmexp.paths import conf_dir
from llmexp.validation import ConfigError, validate
from tests.conftest import compose, run_cli

GROUPS = ["model", "data", "precision", "optimizer", "scheduler", "cluster", "deepspeed", "logger", "experiment"]
NEEDS = {"data/json": ["data.train_file=t.jsonl"], "data/text": ["data.train_file=t.txt"],
         "data/stdlib_sft": ["model.name_or_path=run/model"], "experiment/sft_demo": ["model.name_or_path=run/model"]}


def _options() -> list[tuple[str, str]]:
    return [(g, p.stem) for g in GROUPS for p in sorted((conf_dir() / g).glob("*.yaml"))]


def test_design_groups_have_their_options() -> None:
    have = set(_options())
    for group, option in [("model", "tiny"), ("model", "llama2-7b"), ("data", "stdlib"), ("precision", "bf16"),
                          ("precision", "fp16"), ("precision", "fp32"), ("precision", "auto"), ("optimizer", "adamw"),
                          ("optimizer", "adamw8bit"), ("optimizer", "paged_adamw8bit"), ("optimizer", "lion"),
                          ("optimizer", "lion8bit"), ("optimizer", "sgd"), ("scheduler", "cosine"),
                          ("scheduler", "linear"), ("scheduler", "constant"), ("scheduler", "wsd"),
                          ("cluster", "local"), ("deepspeed", "none"), ("deepspeed", "zero2"),
                          ("deepspeed", "zero2_offload"), ("deepspeed", "zero3"), ("logger", "jsonl"),
                          ("logger", "wandb"), ("logger", "tensorboard"), ("experiment", "seed_llama2_7b")]:
        assert (group, option) in have, f"conf/{group}/{option}.yaml is missing"


def test_every_yaml_opens_with_a_comment_on_when_to_pick_it() -> None:
    for group, option in _options():
        first = (conf_dir() / group / f"{option}.yaml").read_text().lstrip().splitlines()[0]
        assert first.startswith("#"), f"conf/{group}/{option}.yaml must open with a comment"


@pytest.mark.parametrize(("group", "option"), _options())
def test_every_option_composes_and_validates(group: str, option: str, tmp_path: Path) -> None:
    overrides = [f"{group}={option}", *NEEDS.get(f"{group}/{option}", [])]
    if option == "adamw8bit" or option == "paged_adamw8bit" or option == "lion8bit":
        overrides.append("deepspeed=none")
    cfg = compose(overrides, tmp_path)
    validate(cfg)
    assert cfg[group].name if group != "experiment" else cfg.experiment == option


def test_validation_reports_every_error_at_once(tmp_path: Path) -> None:
    cfg = compose(["lr=-1", "train.eval_steps=0", "train.max_steps=10", "train.warmup_steps=20"], tmp_path)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    text = str(err.value)
    for key in ("lr:", "train.eval_steps:", "train.warmup_steps:"):
        assert key in text


@pytest.mark.parametrize(("args", "key"), [
    (["model.hiden_size=3"], "hiden_size"),
    (["batch_size=abc"], "batch_size"),
    (["optimizer=adamw9"], "optimizer"),
    (["lr=-1"], "lr"),
])
def test_bad_overrides_exit_2_and_name_the_key(args: list[str], key: str, tmp_path: Path) -> None:
    proc = run_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"], timeout_s=60)
    assert proc.returncode == 2, proc.stderr
    assert key in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cfg_job_prints_the_composed_config() -> None:
    proc = run_cli(["--cfg", "job", "optimizer=lion"], timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert cfg.optimizer.name == "lion" and cfg.model.hidden_size == 256


def test_help_lists_groups_without_importing_torch() -> None:
    code = ("import sys, runpy; sys.argv=['llmexp','--help'];\n"
            "try:\n  runpy.run_module('llmexp', run_name='__main__')\nexcept SystemExit: pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO_TORCH')")
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "NO_TORCH" in proc.stdout, proc.stdout[-2000:]
    for group in ("model", "optimizer", "precision", "deepspeed", "cluster"):
        assert group in proc.stdout
