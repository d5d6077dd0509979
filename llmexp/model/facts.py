"""What a built model is, for the run's first screen and its `start` record: its id, class, size (the model's own
parameters, and apart from them the trainable ones and the adapters), vocabulary and context length."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmexp.model.build import count_params
from llmexp.model.loss import causal_lm

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from torch import nn


def model_id(cfg: DictConfig) -> str:
    """How the user named the model: its directory or hub id (with the GGUF file), or the config group's name."""
    m = cfg.model
    if not m.name_or_path:
        return str(m.name)
    return f"{m.name_or_path}/{m.gguf_file}" if m.gguf_file else str(m.name_or_path)


def model_facts(cfg: DictConfig, lm: nn.Module) -> dict[str, Any]:
    """The `start` record's model facts. `model_params` leaves the adapters out (the size of the model a user
    chose); `trainable_params` is what the optimizer holds."""
    base = causal_lm(lm)
    config = base.config
    adapter_params = sum(p.numel() for name, p in lm.named_parameters() if "lora_" in name)
    facts: dict[str, Any] = {
        "model_id": model_id(cfg), "architecture": type(base).__name__, "model_type": config.model_type,
        "vocab_size": config.vocab_size, "context_length": getattr(config, "max_position_embeddings", None),
        "model_params": count_params(lm, trainable_only=False) - adapter_params,
        "trainable_params": count_params(lm)}
    if not cfg.model.name_or_path:  # built from the fields: the sizes as built (model.width_mult applied)
        facts["model_shape"] = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
                                "num_attention_heads": config.num_attention_heads,
                                "num_key_value_heads": config.num_key_value_heads,
                                "width_mult": float(cfg.model.width_mult),
                                "parametrization": cfg.model.parametrization}
    if cfg.model.name_or_path and cfg.model.gguf_file:
        facts["gguf_dtype"] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(
            str(next(base.parameters()).dtype).removeprefix("torch."), "fp32")
    if cfg.peft.name != "none":
        from peft.tuners.lora import LoraLayer

        layers = sum(isinstance(module, LoraLayer) for module in lm.modules())
        facts["adapter"] = {"method": cfg.peft.name, "r": int(cfg.peft.r), "modules": layers}
    return facts
