"""Processes and engines: the Accelerate settings derived from the config."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig


def accelerator_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """Arguments for `accelerate.Accelerator`.

    Mixed precision is left to the trainer (its own autocast and fp16 scaler): Accelerate's
    wrapper would cast the whole logits tensor to fp32 after every forward.
    """
    import torch

    return {"cpu": not torch.cuda.is_available(), "mixed_precision": "no"}
