"""muP's coordinate check (Yang et al. 2022, "Tensor Programs V", appendix D.1; the mup package's
`get_coord_data`; docs/tutorials/tune-small-train-big.md): the mean |output| of each layer group at several widths,
which stays flat under muP and grows with the width under the standard parametrization.

Every width trains on the same batch of random tokens from the same seed: coordinate sizes are about how the
parametrization scales with width, not about the text, and a fixed batch keeps the check to seconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from llmexp.config.derived import model_sizes
from llmexp.model.build import build_model, build_optimizer
from llmexp.train.schedule import set_lr

GROUPS = ("embedding", "attention", "mlp", "logits")
"""The layer groups recorded: the embedding's output, each block's attention and MLP outputs (mean over the
blocks), and the logits as the model returns them (muP's 1/m applied)."""


@dataclass(frozen=True)
class CheckSettings:
    """What one coordinate check runs: the width multipliers, optimizer steps, lr, batch and seed."""

    widths: tuple[float, ...]
    steps: int
    lr: float
    batch: int
    seq_len: int
    seed: int


def at_width(cfg: DictConfig, width: float, parametrization: str) -> DictConfig:
    """A copy of `cfg` with `model.width_mult` and `model.parametrization` set."""
    keys = [k for k in cfg if k != "hydra"]  # a run's Hydra node, where composed with it, is none of the check's
    out = OmegaConf.create(OmegaConf.to_container(OmegaConf.masked_copy(cfg, keys), resolve=True))
    out.model.width_mult = float(width)
    out.model.parametrization = parametrization
    return out


def _recorder(model: torch.nn.Module, sizes: dict[str, list[float]]) -> Iterator[Any]:
    """Forward hooks that append each group's mean |activation| to `sizes`; yields the handles."""
    def hook(group: str) -> Any:
        def record(_module: Any, _inputs: Any, output: Any) -> None:
            tensor = output[0] if isinstance(output, tuple) else output
            sizes[group].append(float(tensor.detach().abs().mean()))
        return record

    yield model.get_input_embeddings().register_forward_hook(hook("embedding"))
    for layer in model.model.layers:
        yield layer.self_attn.register_forward_hook(hook("attention"))
        yield layer.mlp.register_forward_hook(hook("mlp"))


def coord_sizes(cfg: DictConfig, settings: CheckSettings, device: torch.device) -> list[dict[str, float]]:
    """One width's coordinate sizes: per step, each group's mean |activation| at that step's forward (step 0: at
    init), the update of the step taken after it."""
    torch.manual_seed(settings.seed)
    model = build_model(cfg, int(cfg.model.vocab_size)).to(device)
    optimizer = build_optimizer(cfg, model, settings.lr, device.type)
    tokens = torch.randint(0, int(cfg.model.vocab_size), (settings.batch, settings.seq_len),
                           generator=torch.Generator().manual_seed(settings.seed)).to(device)
    out = []
    for step in range(settings.steps):
        sizes: dict[str, list[float]] = {g: [] for g in GROUPS}
        handles = list(_recorder(model, sizes))
        result = model(input_ids=tokens, labels=tokens)
        for handle in handles:
            handle.remove()
        sizes["logits"].append(float(result.logits.detach().abs().mean()))
        means = {g: sum(v) / len(v) for g, v in sizes.items()}
        out.append({"step": step, "loss": float(result.loss.detach()), **means})
        result.loss.backward()
        set_lr(optimizer, settings.lr)  # muP's per-part factors, as the trainer applies them
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def _key(width: float) -> str:
    return f"{width:g}"


def coord_check(cfg: DictConfig, settings: CheckSettings, parametrizations: tuple[str, ...],
                device: torch.device) -> dict[str, Any]:
    """The check for each parametrization: every width's curves and each group's growth (its size at the last step,
    widest width over narrowest; 1: flat)."""
    runs: dict[str, Any] = {}
    for name in parametrizations:
        curves = {_key(w): coord_sizes(at_width(cfg, w, name), settings, device) for w in settings.widths}
        narrow, wide = curves[_key(min(settings.widths))][-1], curves[_key(max(settings.widths))][-1]
        runs[name] = {"curves": curves, "growth": {g: wide[g] / narrow[g] for g in GROUPS}}
    base = model_sizes(at_width(cfg, 1.0, "standard").model)
    return {"widths": list(settings.widths), "steps": settings.steps, "lr": settings.lr,
            "optimizer": str(cfg.optimizer.name), "seed": settings.seed, "batch": settings.batch,
            "seq_len": settings.seq_len, "mup_base_width": int(cfg.model.mup_base_width),
            "hidden_sizes": {_key(w): round(base.hidden_size * w) for w in settings.widths},
            "groups": list(GROUPS), "runs": runs}
