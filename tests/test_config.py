"""Config composition and validation: every group option composes, mistakes exit 2 naming the key."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from llmexp.config.keys import leaves
from llmexp.config.rules import Range
from llmexp.config.tree import conf_dir
from llmexp.config.validation import ConfigError, validate
from tests.conftest import compose, run_cli

GROUPS = ["model", "data", "precision", "optimizer", "scheduler", "cluster", "deepspeed", "logger", "peft",
          "experiment", "eval"]
NEEDS = {"data/json": ["data.train_file=t.jsonl"], "data/text": ["data.train_file=t.txt"], "data/hf": ["data.path=d"],
         "data/stdlib_sft": ["model.name_or_path=run/model"], "experiment/sft_demo": ["model.name_or_path=run/model"],
         "peft/qlora": ["model.name_or_path=run/model"],
         "eval/multiple_choice": ["eval.multiple_choice.mc.file=m.jsonl"],
         "eval/generate": ["eval.generate.qa.file=g.jsonl"], "eval/lm_eval": ["eval.lm_eval.tasks=[arc_easy]"]}


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
                          ("logger", "wandb"), ("logger", "tensorboard"), ("logger", "mlflow"),
                          ("experiment", "seed_llama2_7b")]:
        assert (group, option) in have, f"llmexp/conf/{group}/{option}.yaml is missing"


def test_every_yaml_opens_with_a_comment_on_when_to_pick_it() -> None:
    for group, option in _options():
        first = (conf_dir() / group / f"{option}.yaml").read_text().lstrip().splitlines()[0]
        assert first.startswith("#"), f"llmexp/conf/{group}/{option}.yaml must open with a comment"


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


# ---------------------------------------------------------------- every number has a range


@pytest.fixture(scope="module")
def default_cfg(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return compose([], tmp_path_factory.mktemp("run"))


def _with(cfg: Any, key: str, value: Any) -> Any:
    changed = copy.deepcopy(cfg)
    OmegaConf.update(changed, key, value, merge=False)
    return changed


def _errors(cfg: Any) -> str:
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    return str(err.value)


def number_keys() -> dict[str, type]:
    """The int and float fields of the schema."""
    return {key: leaf.type for key, leaf in leaves().items() if leaf.type in (int, float)}


def test_every_number_in_the_schema_has_a_range() -> None:
    """A new int or float field fails here until its field's rule (`key(default, Range(...), doc)`) says what it
    may be."""
    ranged = {key for key in number_keys() if isinstance(leaves()[key].rule, Range)}
    assert set(number_keys()) == ranged, set(number_keys()) ^ ranged


@pytest.mark.parametrize("key", sorted(k for k, tp in number_keys().items() if tp is float))
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_float_field_must_be_finite(default_cfg: Any, key: str, value: float) -> None:
    text = _errors(_with(default_cfg, key, value))
    assert f"{key}: must be a finite number" in text, text


@pytest.mark.parametrize("key", sorted(k for k, tp in number_keys().items() if tp is int))
def test_an_int_field_must_fit_in_64_bits(default_cfg: Any, key: str) -> None:
    text = _errors(_with(default_cfg, key, 2**64))
    assert f"{key}: {2**64} does not fit in 64 bits" in text, text


@pytest.mark.parametrize("key", sorted(number_keys()))
def test_every_number_has_a_lower_bound(default_cfg: Any, key: str) -> None:
    text = _errors(_with(default_cfg, key, -10**6))
    assert f"{key}: must be" in text and "got -1000000" in text, text


@pytest.mark.parametrize(("overrides", "expected"), [
    (["model.num_attention_heads=0"], "model.num_attention_heads: must be >= 1, got 0"),
    (["model.num_key_value_heads=0"], "model.num_key_value_heads: must be >= 1, got 0"),
    (["model.num_attention_heads=4", "model.num_key_value_heads=3"], "model.num_key_value_heads: 3 must divide"),
    (["seed=18446744073709551616"], "seed: 18446744073709551616 does not fit in 64 bits; must be in [0, 2**64 - 1]"),
    (["seed=-1"], "seed: must be in [0, 2**64 - 1], got -1"),
    (["train.sample_max_new_tokens=5000"], "train.sample_max_new_tokens: must be in [1, 4096], got 5000"),  # fits
    (["lr=inf"], "lr: must be > 0 and finite"),
    (["lr=nan"], "lr: must be > 0 and finite"),
    (["train.weight_decay=inf"], "train.weight_decay: must be a finite number, got inf"),
    (["optimizer.betas=[0.9,inf]"], "optimizer.betas: must be two numbers in [0, 1)"),
    (["optimizer.betas=[0.9]"], "optimizer.betas: must be two numbers in [0, 1)"),
    (["+optimizer.kwargs.foreach_eps=inf"], "optimizer.kwargs.foreach_eps: must be a finite number, got inf"),
    (["~train"], "train: is required but was deleted (by ~train"),
    (["~seed"], "seed: is required but was deleted (by ~seed"),
    (["~model"], "model: no model is chosen (removed by ~model?); pick one, e.g. model=tiny (the options are"),
    (["logger.tracking_uri=ftp://host/x"], "logger.tracking_uri=ftp://host/x: ftp:// is not one of http, https"),
    (["logger.tracking_uri=file:///tmp/mlruns"], "MLflow 3 refuses file stores (maintenance mode); use sqlite:///"),
    (["logger.tracking_uri=mlruns"], "MLflow 3 refuses file stores"),
    (["logger.tracking_uri=/tmp/x.db"], "use sqlite:////tmp/x.db, or a server"),  # (was /tmp/x.db/mlflow.db)
    (["logger.tracking_uri=http://host:5000"], "logger.tracking_uri: names an MLflow store, which logger=jsonl "
                                               "would not use: add logger=mlflow"),  # (was ignored)
    (["logger.tracking_uri=http://me:pw@host:5000"], "logger.tracking_uri: holds credentials (user:password@)"),
    (["logger.tracking_uri=http://host:99999"], "logger.tracking_uri=http://host:99999: not a URI (Port out of range"),
    (["logger.tracking_uri=sqlite:///:memory:"], "a SQLite store is sqlite:/// followed by a file path"),
    (["logger.tracking_uri=''"], "logger.tracking_uri: must be a URI without spaces"),
    (["logger.experiment=''"], "logger.experiment: must not be empty"),
    (["logger.experiment=" + "x" * 257], "logger.experiment: is 257 characters long; at most 256"),
    (["logger.init_timeout_s=0"], "logger.init_timeout_s: must be > 0, got 0"),
])
def test_bad_values_name_the_key(overrides: list[str], expected: str, tmp_path: Path) -> None:
    text = _errors(compose(overrides, tmp_path))
    assert expected in text, text


def test_the_top_seed_is_accepted(default_cfg: Any) -> None:
    validate(_with(default_cfg, "seed", 2**64 - 1))
    validate(_with(default_cfg, "train.seed_data", 2**64 - 1))


def test_a_bad_warmup_ratio_does_not_break_the_warmup_rule(default_cfg: Any) -> None:
    """The cross-field rules skip keys whose own range failed (int(nan) would raise)."""
    text = _errors(_with(default_cfg, "train.warmup_ratio", math.nan))
    assert text.count("\n  ") == 1 and "train.warmup_ratio: must be a finite number" in text, text


def test_stdlib_pretraining_lr_comes_with_its_data_and_other_data_keep_lr_auto(tmp_path: Path) -> None:
    """The default run's lr is llmexp/conf/data/stdlib.yaml's `data.pretrain_lr` (measured for it, issue 20), for a
    model trained from scratch only: a fine-tune, even on the stdlib, keeps lr=auto (the seed's table, / 10), as do
    adapters and other data, and a command-line lr wins over all (issue 28)."""
    from llmexp.config.validation import configured_lr
    from llmexp.train.schedule import resolve_lr

    default = compose([], tmp_path)
    assert default.lr == "auto" and configured_lr(default) == (pytest.approx(6e-4), "data")
    assert resolve_lr(default, 7_000_000) == (pytest.approx(6e-4), "data")
    assert configured_lr(compose(["lr=1e-4"], tmp_path)) == (pytest.approx(1e-4), "config")
    finetune = compose(["model.name_or_path=run/model"], tmp_path)
    assert configured_lr(finetune) is None and resolve_lr(finetune, 135_000_000) == (pytest.approx(3e-5), "auto")
    assert resolve_lr(compose(["peft=lora"], tmp_path), 7_000_000) == (pytest.approx(2e-4), "auto-adapter")
    for other in (["data=json", "data.train_file=t.jsonl"], ["model.name_or_path=run/model", "data=stdlib_sft"]):
        assert configured_lr(compose(other, tmp_path)) is None, other


# ---------------------------------------------------------------- the reference the docs are generated from


def test_the_reference_describes_every_key_from_its_field() -> None:
    """`keys.reference()` lists every leaf of the schema (and the launchers' and sweepers' own settings), each with
    a type, a default, its rule in words and a doc, all read from the field (`rules.key`)."""
    from llmexp.config.keys import reference

    docs = {d.key: d for d in reference()}
    assert set(leaves()) <= set(docs) and "hydra.sweeper.max_batch_size" in docs
    assert all(d.doc and d.rule and d.type for d in docs.values()), [d.key for d in docs.values() if not d.doc]
    max_steps = docs["train.max_steps"]
    assert (max_steps.type, max_steps.default) == ("int", 250)
    assert max_steps.rule == "must be >= 1 or -1 (-1 trains for train.num_train_epochs)"
    assert docs["optimizer.name"].rule == "one of: adamw, adamw8bit, lion, lion8bit, paged_adamw8bit, sgd"
    assert (docs["model.name_or_path"].type, docs["model.name_or_path"].default) == ("str | null", None)
    assert (docs["logger.tags"].type, docs["optimizer.betas"].default) == ("list[str]", [0.9, 0.999])
    assert docs["eval.generate.<name>.max_new_tokens"].rule == "must be in [1, 4096]"



@pytest.mark.parametrize(("overrides", "key"), [(["data=hf", "data.path="], "data.path"),
                                                (["data=json", "data.train_file="], "data.train_file")])
def test_an_empty_data_source_is_one_message(overrides: list[str], key: str, tmp_path: Path) -> None:
    """The key's own rule says it must not be empty; the check that the data option needs the key must not say a
    second time that it is missing."""
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides, tmp_path))
    assert str(err.value).count(f"{key}:") == 1, str(err.value)
    assert f"{key}: must not be empty" in str(err.value)


def test_a_wrong_type_for_an_optional_number_suggests_null_not_none() -> None:
    """The example of the fix must itself be valid: `KEY=None` is a string to Hydra, refused again."""
    from llmexp.config.keys import type_problem

    for key in ("train.peak_tflops", "train.warmup_steps", "sweep.base_batch_size", "data.max_examples"):
        problem = type_problem(key, "abc")
        assert problem is not None and "None" not in problem and "or null (unset, the default)" in problem, problem
    assert type_problem("train.max_grad_norm", "abc") == ("train.max_grad_norm=abc: must be a number, "
                                                         "e.g. train.max_grad_norm=1.0")
