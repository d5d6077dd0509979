"""Any causal LM in transformers, from a local directory: tiny random-initialised models of nine
architectures, built from their config classes (no download), saved with save_pretrained and loaded
back through llmexp's own build path (`model.name_or_path=<dir>`).

For each: llmexp's loss equals transformers' own `model(input_ids, labels=...).loss` to 1e-5 in
fp32, one optimizer step moves the weights as a plain PyTorch loop does, and the fused loss head is
used exactly where it is exact (not with logit soft-capping, a biased head, or an unknown model type).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf

from llmexp.model import build
from llmexp.model.loss import CausalLMLoss, fused_head_problem
from tests.conftest import compose, read_metrics, run_cli

VOCAB = 384
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 64, "max_position_embeddings": 64}
NO_DROPOUT = {"attention_dropout": 0.0}

ARCHITECTURES: dict[str, tuple[Any, Any, dict[str, Any], bool]] = {
    # name: (config class, model class, config kwargs, fused head expected)
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {**COMMON, "num_key_value_heads": 2, **NO_DROPOUT}, True),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {**COMMON, "num_key_value_heads": 2, **NO_DROPOUT}, True),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {**COMMON, "num_key_value_heads": 2, "head_dim": 8,
                                                     **NO_DROPOUT}, True),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {**COMMON, "num_key_value_heads": 2, "sliding_window": 8,
                                                          **NO_DROPOUT}, True),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, {**COMMON, "num_key_value_heads": 2, "head_dim": 8,
                                                       "sliding_window": 8, "final_logit_softcapping": 30.0,
                                                       "attn_logit_softcapping": 50.0, **NO_DROPOUT}, False),
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, {**COMMON, "num_key_value_heads": 2, "logits_scaling": 4.0,
                                                          "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                                                          "attention_multiplier": 0.25, **NO_DROPOUT}, True),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {**COMMON, "num_key_value_heads": 2, "pad_token_id": 0,
                                                 "resid_pdrop": 0.0, "embd_pdrop": 0.0, **NO_DROPOUT}, True),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel, {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4,
                                                 "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                                 "attn_pdrop": 0.0}, False),
    "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, {**COMMON, "hidden_dropout": 0.0, **NO_DROPOUT}, False),
    "opt": (tf.OPTConfig, tf.OPTForCausalLM, {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
                                              "num_attention_heads": 4, "ffn_dim": 64, "word_embed_proj_dim": 32,
                                              "max_position_embeddings": 64, "dropout": 0.0,
                                              "attention_dropout": 0.0, "pad_token_id": 1}, False),
}


def save_tiny(name: str, directory: Path) -> Path:
    """A tiny random-initialised model of `name`, written with save_pretrained (what a hub snapshot holds)."""
    config_cls, model_cls, kwargs, _ = ARCHITECTURES[name]
    torch.manual_seed(0)
    model_cls(config_cls(**kwargs)).save_pretrained(directory, safe_serialization=True)
    return directory


def load_through_llmexp(directory: Path, run_dir: Path) -> Any:
    """The model as a run loads it: `model.name_or_path=<dir>` through `llmexp.model.build.build_model`."""
    cfg = compose([f"model.name_or_path={directory}", "train.weight_decay=0.0"], run_dir)
    return cfg, build.build_model(cfg, VOCAB)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(2, VOCAB, (3, 24), generator=gen)
    labels = input_ids.clone()
    labels[0, :5] = -100  # rows with different numbers of targets (SFT-style prompt masking)
    labels[2, 20:] = -100
    return input_ids, labels


def llmexp_mean_loss(lm: Any, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What the trainer computes: CausalLMLoss's token sum divided by the target count."""
    total = CausalLMLoss(lm)(input_ids, labels)
    return total / (labels[:, 1:] != -100).sum()


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_loss_equals_transformers_and_step_equals_plain_loop(name: str, tmp_path: Path) -> None:
    directory = save_tiny(name, tmp_path / "model")
    cfg, lm = load_through_llmexp(directory, tmp_path / "run")
    lm.train()
    assert lm.config.model_type == name
    input_ids, labels = batch()

    # (a) the loss, in fp32
    reference = copy.deepcopy(lm)
    ours = llmexp_mean_loss(lm, input_ids, labels)
    theirs = reference(input_ids=input_ids, labels=labels).loss
    assert abs(ours.item() - theirs.item()) <= 1e-5, (name, ours.item(), theirs.item())

    # (b) one AdamW step: llmexp's optimizer on llmexp's loss vs torch AdamW on transformers' loss
    lr = 1e-3
    optimizer = build.build_optimizer(cfg, CausalLMLoss(lm), lr, "cpu")
    ours.backward()
    plain = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    theirs.backward()
    before = {k: p.detach().clone() for k, p in lm.named_parameters()}
    pairs = list(zip(lm.named_parameters(), reference.named_parameters(), strict=True))
    for (key, p_ours), (_, p_ref) in pairs:
        assert torch.allclose(p_ours.grad, p_ref.grad, rtol=1e-4, atol=1e-7), (name, key)
    optimizer.step()
    plain.step()
    moved = 0
    for (key, p_ours), (_, p_ref) in pairs:
        # Adam's first step is lr * g / (|g| + eps): where |g| is near eps (1e-8) it is ill-conditioned
        # (a 1e-10 difference in g moves it by ~lr), so compare where |g| >> eps; elsewhere the bound is lr.
        clear = p_ref.grad.abs() > 1e-6
        assert torch.allclose(p_ours[clear], p_ref[clear], rtol=0, atol=lr * 1e-3), (name, key)
        assert float((p_ours - p_ref).detach().abs().max()) <= 2 * lr * 1.001, (name, key)
        moved += int(not torch.equal(p_ours, before[key]))
    assert moved == sum(1 for _ in lm.parameters()), f"{name}: only {moved} tensors moved"


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_fused_head_only_where_exact(name: str, tmp_path: Path) -> None:
    directory = save_tiny(name, tmp_path / "model")
    _, lm = load_through_llmexp(directory, tmp_path / "run")
    expected = ARCHITECTURES[name][3]
    assert CausalLMLoss(lm).split is expected, (name, fused_head_problem(lm))


def test_fused_head_skipped_for_soft_capping_a_biased_head_or_an_unknown_type(tmp_path: Path) -> None:
    config_cls, model_cls, kwargs, _ = ARCHITECTURES["llama"]
    capped = model_cls(config_cls(**kwargs))
    capped.config.final_logit_softcapping = 30.0  # a Llama-type config that caps its logits (e.g. a fork)
    assert "soft-capping" in (fused_head_problem(capped) or "")
    biased = model_cls(config_cls(**kwargs))
    biased.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    assert "bias" in (fused_head_problem(biased) or "")
    unknown = model_cls(config_cls(**kwargs))
    unknown.config.model_type = "my_new_arch"
    assert "model type" in (fused_head_problem(unknown) or "")
    # and where the head is skipped the loss still equals transformers'
    input_ids, labels = batch()
    for lm in (capped, biased, unknown):
        assert not CausalLMLoss(lm).split
        ours = llmexp_mean_loss(lm, input_ids, labels).item()
        assert abs(ours - lm(input_ids=input_ids, labels=labels).loss.item()) <= 1e-5


def test_cli_fine_tunes_a_local_qwen2_directory(tmp_path: Path) -> None:
    """End to end: `python -m llmexp model.name_or_path=<a Qwen2 save_pretrained dir>`; model/ loads back."""
    from llmexp.data.tokenizer import train_bpe

    corpus = [f"def f{i}(x):\n    return x * {i}\n" for i in range(200)]
    directory = save_tiny("qwen2", tmp_path / "qwen2")
    train_bpe(corpus, VOCAB).save_pretrained(directory)
    run_dir = tmp_path / "run"
    args = [f"model.name_or_path={directory}", "data.max_length=32", "data.max_examples=40", "batch_size=4",
            "train.max_steps=3", "train.eval_steps=3", "train.eval_batches=1", "train.save_steps=0",
            "train.logging_steps=1", "precision=fp32", "lr=1e-3"]
    result = run_cli([*args, f"hydra.run.dir={run_dir}"], env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(run_dir, "train")]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    reloaded = tf.AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert reloaded.config.model_type == "qwen2"
    start = tf.AutoModelForCausalLM.from_pretrained(directory)
    assert not torch.equal(reloaded.model.layers[0].mlp.up_proj.weight, start.model.layers[0].mlp.up_proj.weight)
    train_bpe(corpus * 4 + [f"v{i} w{i * 7}" for i in range(600)], 2 * VOCAB).save_pretrained(tmp_path / "big")
    too_big = run_cli([*args, f"data.tokenizer={tmp_path / 'big'}", f"hydra.run.dir={tmp_path / 'big-run'}"],
                      env={"HF_HUB_OFFLINE": "1"})  # (issue 40: was an IndexError at the first forward)
    assert too_big.returncode == 2 and "embedding rows" in too_big.stderr, too_big.stderr[-3000:]
    assert "Traceback" not in too_big.stderr and not (tmp_path / "big-run").exists()  # refused before it


def test_a_tokenizer_larger_than_the_built_model_is_refused_before_the_first_step() -> None:
    """The check as the run starts, for what no file tells beforehand (a hub model, a GGUF base)."""
    from omegaconf import OmegaConf

    from llmexp.errors import UserError
    from llmexp.train.setup import _check_vocab
    from tests.conftest import tiny_llama

    cfg = OmegaConf.create({"data": {"tokenizer": "tok"}, "model": {"name_or_path": "org/model"}})
    _check_vocab(cfg, tiny_llama(), 512)
    with pytest.raises(UserError, match="its 513 tokens outnumber the 512 embedding rows"):
        _check_vocab(cfg, tiny_llama(), 513)
    own = OmegaConf.create({"data": {"tokenizer": None}, "model": {"name_or_path": "org/model"}})
    with pytest.raises(UserError, match=r"^model\.name_or_path=org/model: its tokenizer's 513 tokens outnumber its "
                                        r"512 embedding rows; resize the model"):  # not "use data.tokenizer=null"
        _check_vocab(own, tiny_llama(), 513)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_lora_on_every_architecture(name: str, tmp_path: Path) -> None:
    """peft=lora's all-linear finds each architecture's layers (GPT-2's Conv1D included); through the
    peft wrapper the loss still equals transformers' own and every adapter gets a gradient."""
    directory = save_tiny(name, tmp_path / "model")
    cfg = compose([f"model.name_or_path={directory}", "peft=lora", "peft.lora_dropout=0.0"], tmp_path / "run")
    lm = build.build_model(cfg, VOCAB)
    adapters = [p for p in lm.parameters() if p.requires_grad]
    assert len(adapters) >= 2 * 2 * 4, name  # >= 4 adapted layers per block, A and B, 2 blocks
    for p in adapters:  # B starts at zero: give every adapter a value so that a skipped one shows
        torch.nn.init.normal_(p, std=0.05)
    assert CausalLMLoss(lm).split is ARCHITECTURES[name][3]
    input_ids, labels = batch()
    ours = llmexp_mean_loss(lm, input_ids, labels)
    assert abs(ours.item() - lm(input_ids=input_ids, labels=labels).loss.item()) <= 1e-5, name
    ours.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters), name
