"""muP (maximal update parametrization; Yang et al. 2022, "Tensor Programs V", tables 3 and 8) for
`model.parametrization=mup`: a config tuned at `model.mup_base_width` keeps its optimum as the width grows.
The rules per parameter part are in docs/tutorials/tune-small-train-big.md; the model is transformers'
`GraniteForCausalLM` (Llama's layout plus muP's multipliers).

The rules are the `mup` package's (microsoft/mup), written out instead of depending on it: it has had no commit
since 2023, and the `infshape` it attaches to every parameter does not survive `torch.save` / a checkpoint's load,
which a resumed run needs. A group's lr factor is its `lr_mult`, applied by `train.schedule.set_lr`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from llmexp.errors import UserError

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

    from llmexp.config.derived import ModelSizes

LR_MULT = "lr_mult"
"""A param group's lr factor over the scheduled (logged) lr; absent means 1 (standard runs, older checkpoints)."""
ADAM_LIKE = ("adamw", "adamw8bit", "paged_adamw8bit", "lion", "lion8bit")
"""Optimizers whose update is entrywise normalised (Adam) or a sign (Lion): muP's Adam rule."""
SGD_LIKE = ("sgd",)


def lr_mult(group: dict[str, Any]) -> float:
    """The group's lr factor; a group without one (standard runs, checkpoints from before muP) has 1."""
    return float(group.get(LR_MULT, 1.0))


def granite_multipliers(sizes: ModelSizes, m: DictConfig) -> dict[str, float]:
    """GraniteConfig's multipliers for muP at these sizes, with the model's alpha_input and alpha_output
    (`mup_input_mult`, `mup_output_mult`). The head size stays fixed as the width grows (heads scale with it), so
    attention keeps 1/sqrt(head_dim): muP's 1/head_dim differs from it by a constant only when head_dim scales,
    which it does not here."""
    return {"embedding_multiplier": float(m.mup_input_mult), "residual_multiplier": 1.0,
            "attention_multiplier": sizes.head_dim ** -0.5,  # Granite divides the logits by logits_scaling
            "logits_scaling": sizes.mup_width_mult(m.mup_base_width) / float(m.mup_output_mult)}


def _parts(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """The model's parameters by the muP rule they follow: `hidden` (both dimensions grow with the width), `head`
    (the output head's), `embedding`, or `vector` (norms, biases: one width dimension)."""
    embeddings = {id(p) for mod in model.modules() if mod.__class__.__name__ == "Embedding" for p in mod.parameters()}
    head = {id(p) for name, mod in model.named_modules() if name.split(".")[-1] == "lm_head"
            for p in mod.parameters()}
    parts: dict[str, list[torch.Tensor]] = {"hidden": [], "head": [], "embedding": [], "vector": []}
    for param in model.parameters():
        if id(param) in head:
            parts["head"].append(param)
        elif id(param) in embeddings:
            parts["embedding"].append(param)
        else:
            parts["hidden" if param.ndim >= 2 else "vector"].append(param)
    return parts


def rescale_init(model: torch.nn.Module, mult: float) -> None:
    """muP's init from the standard one: hidden matrices' std / sqrt(m). Embeddings and norms keep theirs, and
    so does the head: `MuReadout` multiplies torch's fan-in init (std ~ 1/sqrt(width)) by sqrt(m) to make it
    width-independent, and transformers' init (`initializer_range`) is width-independent already."""
    import torch

    with torch.no_grad():
        for param in _parts(model)["hidden"]:
            param.mul_(1.0 / math.sqrt(mult))


def mup_groups(cfg: DictConfig, model: torch.nn.Module, mult: float) -> list[dict[str, Any]]:
    """The optimizer's param groups under muP, each with its `lr_mult` and weight decay: always in the order
    hidden, head, embedding, vector (empty ones left out), so a checkpoint's groups fit on resume."""
    name, wd, decay_all = cfg.optimizer.name, cfg.train.weight_decay, cfg.optimizer.decay_norms_and_biases
    if name in ADAM_LIKE:  # MuAdam: matrix-like (two width dimensions) lr / m, weight decay x m
        rules = {"hidden": (1 / mult, wd * mult), "head": (1.0, wd), "embedding": (1.0, wd if decay_all else 0.0),
                 "vector": (1.0, wd if decay_all else 0.0)}
    elif name in SGD_LIKE:  # MuSGD: vector-like (one width dimension) lr x m, weight decay / m; hidden fan-in/out 1
        vec_wd = wd / mult if decay_all else 0.0
        rules = {"hidden": (1.0, wd), "head": (mult, wd / mult), "embedding": (mult, vec_wd), "vector": (mult, vec_wd)}
    else:
        raise UserError(f"model.parametrization=mup: no muP rule for optimizer={name}; use one of "
                        f"{', '.join(ADAM_LIKE + SGD_LIKE)}")
    params = {part: [p for p in group if p.requires_grad] for part, group in _parts(model).items()}
    return [{"params": params[part], "weight_decay": decay, LR_MULT: factor, "mup_part": part}
            for part, (factor, decay) in rules.items() if params[part]]
