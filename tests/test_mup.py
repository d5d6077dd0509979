"""muP (`model.parametrization=mup`), `model.width_mult` and `python -m llmexp.coord_check` (issue 38).

At its base width muP is the standard model weight for weight and loss for loss; away from it the per-part lrs
follow the mup package's MuAdam / MuSGD; the refusals exit 2 naming the key; a mup run resumes; and the coord
check shows what muP is for: the logits' coordinate size stays flat across widths under mup and grows under
standard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from llmexp.config.validation import ConfigError, validate
from tests.conftest import TINY, compose, read_metrics, run_cli

SMALL = ["model.mup_base_width=64", "train.weight_decay=0.1"]
"""TINY's width (64) as the base: at model.width_mult=1 mup is standard."""


def _cfg(tmp_path: Path, *overrides: str) -> Any:
    return compose([*TINY, *SMALL, *overrides], tmp_path)


def _built(cfg: Any) -> torch.nn.Module:
    from llmexp.model.build import build_model

    torch.manual_seed(0)
    return build_model(cfg, cfg.model.vocab_size)


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=tokens, labels=tokens).loss)


def test_mup_at_the_base_width_is_standard(tmp_path: Path) -> None:
    """Same weights (so the same init std) and the same loss for one seed; the first Adam step the same too."""
    from llmexp.model.build import build_optimizer

    std, mup = _built(_cfg(tmp_path)), _built(_cfg(tmp_path, "model.parametrization=mup"))
    assert (type(std).__name__, type(mup).__name__) == ("LlamaForCausalLM", "GraniteForCausalLM")
    a, b = std.state_dict(), mup.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    assert _loss(mup, tokens) == pytest.approx(_loss(std, tokens), rel=1e-6)
    for model, cfg in ((std, _cfg(tmp_path)), (mup, _cfg(tmp_path, "model.parametrization=mup"))):
        opt = build_optimizer(cfg, model, 1e-2, "cpu")
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
    assert _loss(mup, tokens) == pytest.approx(_loss(std, tokens), rel=1e-5)


def test_mup_scales_hidden_init_and_logits_with_the_width(tmp_path: Path) -> None:
    """width_mult=4 (m=4): hidden matrices' std / 2, embeddings and head unchanged, logits / 4; the sizes scale
    with the head size fixed."""
    model = _built(_cfg(tmp_path, "model.parametrization=mup", "model.width_mult=4"))
    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads) == (256, 512, 8, 8)
    assert c.logits_scaling == 4 and c.attention_multiplier == pytest.approx(32 ** -0.5)
    stds = {n: float(p.std()) for n, p in model.named_parameters()}
    assert stds["model.layers.0.mlp.up_proj.weight"] == pytest.approx(0.01, rel=0.05)
    assert stds["model.layers.0.self_attn.q_proj.weight"] == pytest.approx(0.01, rel=0.05)
    assert stds["model.embed_tokens.weight"] == pytest.approx(0.02, rel=0.05)
    assert stds["lm_head.weight"] == pytest.approx(0.02, rel=0.05)


def test_the_mup_multipliers_scale_embeddings_and_logits_at_every_width(tmp_path: Path) -> None:
    """alpha_input multiplies the embeddings' output, alpha_output the logits (over the 1/m of the width): the
    same weights with alpha_output=2 give twice the logits."""
    model = _built(_cfg(tmp_path, "model.parametrization=mup", "model.width_mult=4", "model.mup_input_mult=16",
                        "model.mup_output_mult=2"))
    assert (model.config.embedding_multiplier, model.config.logits_scaling) == (16.0, 2.0)
    one = _built(_cfg(tmp_path, "model.parametrization=mup"))
    two = _built(_cfg(tmp_path, "model.parametrization=mup", "model.mup_output_mult=2"))
    two.load_state_dict(one.state_dict())
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(two(input_ids=tokens).logits, 2 * one(input_ids=tokens).logits)


def test_width_mult_scales_the_standard_model_and_its_estimate(tmp_path: Path) -> None:
    """model.width_mult=2 on the standard model: the four sizes doubled, the head size kept, and the meta-device
    count (`python -m llmexp.estimate`, batch_size=auto) the same as the built model's."""
    from llmexp.model.build import count_params
    from llmexp.model.estimate import count_params_meta

    cfg = _cfg(tmp_path, "model.width_mult=2")
    model = _built(cfg)
    c = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads) == (128, 256, 4, 4)
    assert count_params_meta(cfg) == count_params(model, trainable_only=False)


@pytest.mark.parametrize(("optimizer", "expected"), [
    # MuAdam: hidden lr / m and weight decay x m; the rest as standard
    ("adamw", {"hidden": (0.25, 0.4), "head": (1.0, 0.1), "embedding": (1.0, 0.0), "vector": (1.0, 0.0)}),
    ("lion", {"hidden": (0.25, 0.4), "head": (1.0, 0.1), "embedding": (1.0, 0.0), "vector": (1.0, 0.0)}),
    # MuSGD: one width dimension (embeddings, norms, head) lr x m and weight decay / m; hidden unchanged
    ("sgd", {"hidden": (1.0, 0.1), "head": (4.0, 0.025), "embedding": (4.0, 0.0), "vector": (4.0, 0.0)}),
])
def test_per_group_lr_follows_the_optimizer(optimizer: str, expected: dict[str, tuple[float, float]],
                                            tmp_path: Path) -> None:
    """Each part's group gets its lr factor and weight decay; `set_lr` applies the factor, the logged lr is the
    base one; the groups come in one fixed order (a checkpoint's fit on resume)."""
    from llmexp.model.build import build_optimizer
    from llmexp.train.schedule import base_lr, set_lr

    cfg = _cfg(tmp_path, "model.parametrization=mup", "model.width_mult=4", f"optimizer={optimizer}")
    opt = build_optimizer(cfg, _built(cfg), 1e-3, "cpu")
    got = {g["mup_part"]: (g["lr_mult"], g["weight_decay"]) for g in opt.param_groups}
    assert [g["mup_part"] for g in opt.param_groups] == ["hidden", "head", "embedding", "vector"]
    assert got == pytest.approx(expected)
    set_lr(opt, 2e-3)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([2e-3 * f for f, _ in expected.values()])
    assert base_lr(opt) == pytest.approx(2e-3)


def test_lr_auto_under_mup_is_the_base_widths(tmp_path: Path) -> None:
    """lr=auto reads the seed's table at the base width's size (muP then scales it per layer), not at the widened
    model's: a 6.7B-parameter widening of a ~42M base gets the < 1B row (3e-4), standard the 1-7B row (2e-4)."""
    from llmexp.model.estimate import count_params_meta
    from llmexp.train.schedule import base_width_params, resolve_lr

    cfg = _cfg(tmp_path, "model.parametrization=mup", "model.width_mult=4")
    base = _cfg(tmp_path, "model.parametrization=standard", "model.width_mult=1")
    assert base_width_params(cfg) == count_params_meta(base) < count_params_meta(cfg)  # the count, Llama's layout
    big = ["model.hidden_size=4096", "model.num_attention_heads=32", "model.num_key_value_heads=32",
           "model.intermediate_size=11008", "model.num_hidden_layers=32", "model.vocab_size=32000",
           "model.mup_base_width=256", "lr=auto", "data.pretrain_lr=null"]
    widened = compose([*TINY, *big, "model.parametrization=mup"], tmp_path)
    assert 3e7 < base_width_params(widened) < 1e9 < count_params_meta(widened)
    assert resolve_lr(widened, count_params_meta(widened)) == (3e-4, "auto")
    standard = compose([*TINY, *big], tmp_path)
    assert resolve_lr(standard, count_params_meta(standard)) == (2e-4, "auto")


def test_standard_groups_have_no_factor(tmp_path: Path) -> None:
    from llmexp.model.build import build_optimizer
    from llmexp.train.schedule import base_lr, set_lr

    cfg = _cfg(tmp_path)
    opt = build_optimizer(cfg, _built(cfg), 1e-3, "cpu")
    assert len(opt.param_groups) == 2 and not any("lr_mult" in g for g in opt.param_groups)
    set_lr(opt, 5e-4)
    assert [g["lr"] for g in opt.param_groups] == [5e-4, 5e-4] and base_lr(opt) == 5e-4


@pytest.mark.parametrize(("overrides", "key", "fragment"), [
    (["model.parametrization=mup", "model.tie_word_embeddings=true"], "model.tie_word_embeddings",
     "use model.tie_word_embeddings=false"),
    (["model.parametrization=mup", "model.name_or_path=gpt2"], "model.parametrization", "pretrained"),
    (["model.width_mult=1.3"], "model.width_mult", "not whole numbers"),
    (["model.width_mult=2", "model.name_or_path=gpt2"], "model.width_mult", "drop model.width_mult"),
    (["model.width_mult=0"], "model.width_mult", "must be > 0"),
    (["model.mup_input_mult=16"], "model.mup_input_mult", "set model.parametrization=mup"),
    (["model.mup_output_mult=2"], "model.mup_output_mult", "the standard model has no multiplier"),
    # widened by hidden_size alone: muP's rules would scale an MLP and heads that did not grow (was accepted)
    (["model.parametrization=mup", "model.hidden_size=256"], "model.mup_base_width",
     "64 implies a base model with num_attention_heads=0.5, num_key_value_heads=0.5 (each width / m"),
])
def test_validation_refuses(overrides: list[str], key: str, fragment: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        validate(_cfg(tmp_path, *overrides))
    assert f"{key}:" in str(err.value) and fragment in str(err.value)


def test_width_mult_takes_factors_that_give_whole_sizes(tmp_path: Path) -> None:
    """0.5 halves TINY (32 wide, one head of 32): fine; 1.5 with one KV head would make 1.5 of them."""
    validate(_cfg(tmp_path, "model.width_mult=0.5"))
    with pytest.raises(ConfigError, match=r"num_key_value_heads=1 x 1.5 = 1.5"):
        validate(_cfg(tmp_path, "model.num_key_value_heads=1", "model.width_mult=1.5"))


def test_the_cli_refuses_mup_with_adapters(tmp_path: Path) -> None:
    done = run_cli(["model.parametrization=mup", "peft=lora", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "model.parametrization:" in done.stderr and "peft=none" in done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_mup_run_writes_its_run_dir_and_resumes(tmp_path: Path) -> None:
    """A short mup run at width 2 writes its run directory (the model as built in the start record, the base lr
    logged); run again with more steps it resumes from its checkpoint, the groups' factors loaded with it."""
    from llmexp.train.train import train

    run_dir = tmp_path / "run"
    args = ["model.parametrization=mup", "model.width_mult=2", "lr=1e-3", "train.eval_steps=100",
            "train.save_steps=2", "logger=jsonl", "train.peak_tflops=1.0", "train.warmup_steps=0",
            "scheduler=constant"]
    first = train(compose([*TINY, *SMALL, *args, "train.max_steps=2"], run_dir))
    assert first.status == "completed" and (run_dir / "model" / "config.json").is_file()
    start = read_metrics(run_dir, "start")[0]
    assert start["architecture"] == "GraniteForCausalLM"
    assert start["model_shape"] == {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                                    "num_key_value_heads": 4, "width_mult": 2.0, "parametrization": "mup"}
    second = train(compose([*TINY, *SMALL, *args, "train.max_steps=3"], run_dir))
    assert second.status == "completed" and second.step == 3
    assert [r["step"] for r in read_metrics(run_dir, "resume")] == [2]
    assert [r["lr"] for r in read_metrics(run_dir, "train")] == pytest.approx([1e-3] * 3)
    from llmexp.checkpoint.serialize import load_state

    saved = load_state(sorted(run_dir.glob("checkpoints/*/optimizer.pt"))[-1])  # (weights_only: no unpickling)
    assert [(g["mup_part"], g["lr_mult"]) for g in saved["param_groups"]] == [
        ("hidden", 0.5), ("head", 1.0), ("embedding", 1.0), ("vector", 1.0)]


def test_coord_check_logits_stay_flat_under_mup_and_grow_under_standard(tmp_path: Path) -> None:
    """muP's own check, as `python -m llmexp.coord_check` runs it (widths 1 and 4 of its small model, 5 Adam steps
    at lr 3e-3): the logits' coordinate size after the steps is about the same at both widths under mup
    (widest / narrowest < 2; 0.98-1.15 over seeds 0-2) and clearly larger at the wider one under standard
    (3.4-5.2 over those seeds); the hidden outputs grow too under standard."""
    from llmexp.cli.coord_check import SMALL_MODEL
    from llmexp.train.coord_check import CheckSettings, coord_check

    cfg = compose([*SMALL_MODEL, "batch_size=4"], tmp_path)
    settings = CheckSettings(widths=(1.0, 4.0), steps=5, lr=3e-3, batch=4, seq_len=32, seed=0)
    result = coord_check(cfg, settings, ("standard", "mup"), torch.device("cpu"))
    mup, std = result["runs"]["mup"]["growth"], result["runs"]["standard"]["growth"]
    assert mup["logits"] < 2 and std["logits"] > 2.5 and std["logits"] > 2 * mup["logits"], (mup, std)
    assert std["mlp"] > 3 * mup["mlp"] and std["attention"] > 3 * mup["attention"], (mup, std)
    assert [c["step"] for c in result["runs"]["mup"]["curves"]["4"]] == [0, 1, 2, 3, 4]


def test_the_coord_check_command_writes_its_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command (its `main`, in this process: a subprocess would import torch again) writes coord_check.json
    and .png and prints their paths and each group's growth; a width that gives no whole sizes is exit 2."""
    import json

    from llmexp.cli.coord_check import main

    out = tmp_path / "cc"
    # the parametrization as Hydra reads it (a `++` or a quoted value ran both parametrizations)
    assert main(['++model.parametrization="mup"', "--widths", "1,2", "--steps", "2", "--out", str(out),
                 "model.num_hidden_layers=1", "batch_size=2", "data.max_length=16"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out / 'coord_check.json'}" in printed and f"wrote {out / 'coord_check.png'}" in printed
    result = json.loads((out / "coord_check.json").read_text())
    assert list(result["runs"]) == ["mup"] and result["hidden_sizes"] == {"1": 64, "2": 128}
    assert (out / "coord_check.png").stat().st_size > 0
    assert main(["--widths", "1,1.3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--widths 1,1.3: 1.3 gives sizes that are not whole numbers" in err and "model.width_mult" not in err
    assert main(["model.width_mult=4", "--out", str(out)]) == 2  # (was ignored: the check sets it per width)
    assert "model.width_mult=4.0: the check sets the width itself; give the widths with --widths" in \
        capsys.readouterr().err


def test_the_coord_check_refuses_an_out_that_is_a_file_before_it_runs(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from llmexp.cli.coord_check import main

    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    for out in (notes, notes / "cc"):
        assert main(["--out", str(out)]) == 2
        captured = capsys.readouterr()
        assert f"--out={out}: " in captured.err and "is a file" in captured.err and "coord check:" not in captured.err
    assert notes.read_text() == "mine\n" and sorted(tmp_path.iterdir()) == [notes]


def test_the_coord_check_help_imports_no_torch() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "llmexp.coord_check", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--widths" in done.stdout
    assert not [line for line in done.stderr.splitlines() if line.rstrip().endswith("| torch")]
