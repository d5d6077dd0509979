"""Learning-rate schedules as pure functions of the step, the seed's lr-by-size rule, and the peak lr.

The trainer sets each group's lr to `lr_at(step, ...)` (times the group's muP factor: `set_lr`) before every
optimizer step, so the schedule holds no state: resuming at step k gives exactly the lr of step k (cf. transformers
#34053), and nothing is handed to `accelerator.prepare` (which would step it once per process, accelerate #2318).
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig

from llmexp.config.derived import model_sizes
from llmexp.config.validation import configured_lr
from llmexp.model.mup import lr_mult


def set_lr(optimizer: Any, lr: float) -> None:
    """Set every param group's lr to `lr` times the group's own factor (`lr_mult`: muP's per-part lrs, 1 for
    a standard run). The one place the trainer and the lr range test set the lr."""
    for group in optimizer.param_groups:
        group["lr"] = lr * lr_mult(group)


def base_lr(optimizer: Any) -> float:
    """The lr `set_lr` was last given (the schedule's, which the metrics log), from the first group."""
    group = optimizer.param_groups[0]
    return group["lr"] / lr_mult(group)


# The seed's table (section 2.2): parameter count -> recommended peak lr for pretraining.
LR_BY_SIZE: tuple[tuple[float, float], ...] = ((1e9, 3e-4), (7e9, 2e-4), (70e9, 1e-4), (math.inf, 7e-5))
FINETUNE_DIVISOR = 10.0
"""The seed: fine-tune at 1/10 to 1/5 of the pretraining lr; we take the conservative end."""


def auto_lr(num_params: int, finetune: bool) -> float:
    """The seed's rule of thumb (`LR_BY_SIZE`), / 10 to fine-tune."""
    lr = next(lr for limit, lr in LR_BY_SIZE if num_params < limit)
    return lr / FINETUNE_DIVISOR if finetune else lr


def lr_at(step: int, *, name: str, peak_lr: float, max_steps: int, warmup_steps: int,
          min_lr_ratio: float = 0.0, decay_ratio: float = 0.2) -> float:
    """The lr used by optimizer step `step` (0-based): a linear warm-up to the peak over `warmup_steps` (step 0
    already gets a non-zero lr, so no step is wasted), then `name`'s decay to `min_lr_ratio` of the peak (wsd: over
    the last `decay_ratio` of the steps)."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    min_lr = peak_lr * min_lr_ratio
    if name == "constant":
        return peak_lr
    if name == "wsd":
        decay_start = max_steps - max(1, round(decay_ratio * max_steps))
        if step < max(decay_start, warmup_steps):
            return peak_lr
        progress = (step - decay_start) / max(1, max_steps - decay_start)
        return peak_lr - (peak_lr - min_lr) * min(1.0, progress)
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if name == "linear":
        return peak_lr - (peak_lr - min_lr) * progress
    if name == "cosine":
        return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown scheduler {name!r}")


ADAPTER_LR_BY_SIZE: tuple[tuple[float, float], ...] = ((20e9, 2e-4), (math.inf, 1e-4))
"""lr=auto with LoRA/QLoRA, by the base model's parameter count: the QLoRA paper's (docs/how-to/pretrained-models.md).
Adapters start at zero (B = 0) and are small: they take a pretraining-size lr, not the seed's 1/10 fine-tuning rule."""


def auto_adapter_lr(total_params: int) -> float:
    return next(lr for limit, lr in ADAPTER_LR_BY_SIZE if total_params < limit)


def resolve_lr(cfg: DictConfig, num_params: int) -> tuple[float, str]:
    """The peak lr and where it came from (`config`; `data`: the data's pretraining lr, from scratch only;
    `auto` by the seed's table; or `auto-adapter`: the QLoRA paper's rule for adapters). `num_params` counts
    every weight of the model, frozen or not."""
    if (configured := configured_lr(cfg)) is not None:
        return configured
    if cfg.peft.name != "none":
        return auto_adapter_lr(num_params), "auto-adapter"
    if cfg.model.parametrization == "mup":  # muP's lr is the base width's, which it then scales per layer
        return auto_lr(base_width_params(cfg), finetune=False), "auto"
    return auto_lr(num_params, finetune=bool(cfg.model.name_or_path)), "auto"


def base_width_params(cfg: DictConfig) -> int:
    """Parameters of the model at `model.mup_base_width`, where muP is the standard parametrization: the size
    whose lr the seed's table gives, and muP carries to the wider model. Counted from the sizes (Llama's layout,
    as muP's Granite has it; untied, as muP requires), since a base width need not split into whole heads."""
    m = cfg.model
    sizes = model_sizes(m)
    h, shrink = m.mup_base_width, m.mup_base_width / sizes.hidden_size
    kv = sizes.num_key_value_heads * sizes.hidden_size / sizes.num_attention_heads * shrink  # k and v widths
    block = 2 * h * h + 2 * h * kv + 3 * h * sizes.intermediate_size * shrink + 2 * h  # q, o; k, v; the MLP; norms
    return round(2 * m.vocab_size * h + m.num_hidden_layers * block + h)  # embedding and head; the final norm
