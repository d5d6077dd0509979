"""Build the model, the optimizer and the precision setting from the config.

This is the one place that instantiates classes named in the config. Optimizer classes come
from `_target_`, but only from the allow-list below: a config is data, never code to run.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import TYPE_CHECKING, Any

from llmexp.errors import UserError

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig
    from transformers import PreTrainedModel

ALLOWED_TARGETS: tuple[str, ...] = ("torch.optim.", "bitsandbytes.optim.", "llmexp.")
"""`_target_` prefixes that may be instantiated. Everything else is rejected (exit 2)."""


def check_target(target: str, key: str) -> None:
    """Reject a `_target_` outside the allow-list before anything is imported (`llmexp.config.security`)."""
    from llmexp.config.security import target_problem

    if problem := target_problem(target, ALLOWED_TARGETS):
        raise UserError(f"{key}: {problem}. Pick an optimizer with optimizer=<name>.")


def locate(target: str) -> Any:
    """Import `pkg.module.Class` (after `check_target`)."""
    module_name, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise UserError(f"optimizer._target_: cannot import {target!r} ({err}); is its package installed?") from err














def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a resolved precision; None for fp32."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def _from_pretrained(cls: Any, cfg: DictConfig) -> Any:
    from llmexp.data.tokenizer import hub_error, hub_load_kwargs

    m = cfg.model
    kwargs = hub_load_kwargs(m.name_or_path)  # offline fast path when the hub is unreachable
    try:
        return cls.from_pretrained(m.name_or_path, revision=m.revision, trust_remote_code=m.trust_remote_code,
                                   **kwargs)
    except OSError as err:
        raise hub_error(m.name_or_path, err) from err


def build_model(cfg: DictConfig, vocab_size: int) -> PreTrainedModel:
    """A fresh Llama-style model from the config fields, or a pretrained one from `name_or_path`.

    Weights stay in fp32 (the master copy); autocast runs the matmuls in bf16/fp16.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    m = cfg.model
    if m.name_or_path:
        config = _from_pretrained(AutoConfig, cfg)
        model = _from_pretrained(AutoModelForCausalLM, cfg)
        model.config = config
        model.float()
    else:
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
            num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_key_value_heads, max_position_embeddings=m.max_position_embeddings,
            rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings,
            attention_dropout=m.attention_dropout, attn_implementation="sdpa",
        )
        model = LlamaForCausalLM(config)
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def param_groups(model: torch.nn.Module, weight_decay: float, decay_all: bool) -> list[dict[str, Any]]:
    """Decay matrices only: biases, norms and embeddings keep their scale (the usual LLM recipe)."""
    embeddings = {id(p) for mod in model.modules() if mod.__class__.__name__ == "Embedding" for p in mod.parameters()}
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        matrix = param.ndim >= 2 and id(param) not in embeddings
        (decay if matrix or decay_all else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg: DictConfig, model: torch.nn.Module, lr: float, device_type: str) -> torch.optim.Optimizer:
    """The allow-listed optimizer class with only the arguments its constructor accepts."""
    o = cfg.optimizer
    check_target(o._target_, "optimizer._target_")
    target = o._target_
    if device_type == "cpu" and target.startswith("bitsandbytes."):
        # bitsandbytes' CPU backend warns at import that its 4-bit matmul kernels are missing: optimizers never use them
        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    cls = locate(target)
    import torch

    from llmexp.config.security import check_located

    check_located(cls, target, "optimizer._target_", ALLOWED_TARGETS, base=torch.optim.Optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    candidates: dict[str, Any] = {"betas": tuple(o.betas), "eps": o.eps, "momentum": o.momentum}
    kwargs = {k: v for k, v in candidates.items() if k in accepted}
    if "fused" in accepted and o.name == "adamw":
        kwargs["fused"] = True  # one kernel per step instead of a loop over tensors; CPU and CUDA both have it
    kwargs.update(dict(o.kwargs))
    groups = param_groups(model, cfg.train.weight_decay, o.decay_norms_and_biases)
    try:
        return cls(groups, lr=lr, **kwargs)
    except (ValueError, TypeError) as err:  # torch and bitsandbytes check their arguments: e.g. eps < 0
        raise UserError(f"optimizer: {target} rejected its arguments {kwargs} ({err}); "
                        "fix optimizer.* or optimizer.kwargs.*") from err


def count_params(model: torch.nn.Module) -> int:
    """Trainable parameters (shared tensors counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
