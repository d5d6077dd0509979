"""Build the model, the optimizer and the precision setting from the config.

This is the one place that instantiates classes named in the config. Optimizer classes come
from `_target_`, but only from the allow-list below: a config is data, never code to run.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmexp.errors import UserError

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig
    from transformers import PreTrainedModel

ALLOWED_TARGETS: tuple[str, ...] = ("torch.optim.", "bitsandbytes.optim.", "llmexp.")
"""`_target_` prefixes that may be instantiated. Everything else is rejected (exit 2)."""


def check_target(target: str, key: str) -> None:
    """Reject a `_target_` outside the allow-list before anything is imported (`llmexp.security`)."""
    from llmexp.security import target_problem

    if problem := target_problem(target, ALLOWED_TARGETS):
        raise UserError(f"{key}: {problem}. Pick an optimizer with optimizer=<name>.")


def locate(target: str) -> Any:
    """Import `pkg.module.Class` (after `check_target`)."""
    module_name, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise UserError(f"optimizer._target_: cannot import {target!r} ({err}); is its package installed?") from err


@cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 dot products (AVX512-BF16 or AMX).

    LLMEXP_ASSUME_NO_BF16=1 answers False: it simulates older hardware (tests, reproductions).
    """
    if os.environ.get("LLMEXP_ASSUME_NO_BF16") == "1":
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


BF16_EMULATED_SLOWDOWN = "about 3-4x"
"""Expected step-time cost of emulated bf16 against fp32 on a CPU without native bf16.

Estimated, not measured on such a CPU: on this machine (Xeon with AVX512-BF16) torch's bf16 path
without oneDNN (`torch.backends.mkldnn.enabled=False`, `ATEN_CPU_CAPABILITY=avx2`: what torch uses
on CPUs without AVX512, e.g. AMD Zen 3) ran a default-model training step 3.6x slower than fp32,
its 1024x1024 bf16 matmul ~40x slower. CPUs with AVX512 but no AVX512-BF16 emulate in oneDNN,
which costs less. `LLMEXP_ASSUME_NO_BF16=1` only changes llmexp's decisions, not torch's kernels."""


def bf16_support(device_type: str) -> str:
    """`native` (fast bf16 matmuls), `emulated` (torch runs bf16 in software or converts, slowly) or `none`.

    Every x86/ARM CPU runs bf16 autocast, natively or emulated. On CUDA, Ampere and newer are native;
    older GPUs are `emulated` when torch can create and compute bf16 tensors there (its own
    `including_emulation` test), else `none`.
    """
    if device_type == "cpu":
        return "native" if cpu_has_fast_bf16() else "emulated"
    import torch

    if device_type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "native"
        return "emulated" if torch.cuda.is_bf16_supported(including_emulation=True) else "none"
    return "native"  # mps, xpu: torch decides; autocast raises its own clear error if it cannot


def resolve_precision(name: str, device_type: str) -> str:
    """bf16/fp16/fp32 for this device; `auto` picks bf16 where it is native (fast), else fp32.

    `precision=bf16` runs wherever torch can run it; where bf16 is emulated the run warns (see
    `bf16_emulation_warning`). Only a GPU on which torch cannot compute in bf16 at all is refused.
    """
    support = bf16_support(device_type)
    if name == "auto":
        return "bf16" if support == "native" else "fp32"
    if name == "bf16" and support == "none":
        raise UserError("precision=bf16: torch cannot compute in bf16 on this GPU (not even emulated). "
                        "Use precision=auto (fp32 here) or precision=fp16.")
    return name


def bf16_emulation_warning(precision: str, device_type: str) -> str | None:
    """The warning for a bf16 run on hardware that emulates it (None when bf16 is native or unused)."""
    if precision != "bf16" or bf16_support(device_type) != "emulated":
        return None
    if device_type == "cpu":
        return (f"precision=bf16 on a CPU without native bf16 (AVX512-BF16 or AMX): torch emulates it, so training "
                f"is expected to be {BF16_EMULATED_SLOWDOWN} slower than fp32 (estimated, see the README)")
    return ("precision=bf16 on a GPU without native bf16 (before Ampere): torch emulates it, so training is "
            "expected to be slower than fp32")


BF16_EMULATION_ADVICE = ("Use precision=auto (fp32 on this hardware) for the faster run; keep bf16 only to "
                         "match bf16 numerics.")


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a resolved precision; None for fp32."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def _from_pretrained(cls: Any, cfg: DictConfig) -> Any:
    from llmexp.tokenizer import hub_error, hub_load_kwargs

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

    from llmexp.security import check_located

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
