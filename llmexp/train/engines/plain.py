"""The plain engine (the `Engine` base and what the loop calls when: `base.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmexp.checkpoint import serialize
from llmexp.train.engines.base import Engine, OptimizerWriter, inner_optimizer


class PlainEngine(Engine):
    """One process or DDP through Accelerate (the base's defaults: DDP's state is replicated, so it reshards); fp16
    runs through torch's GradScaler."""

    def __init__(self, accelerator: Any, precision: str, init_scale: float, growth_interval: int, *,
                 trainable_only: bool = False) -> None:
        self.accelerator = accelerator
        self.scaler = (torch.amp.GradScaler(accelerator.device.type, init_scale=init_scale,
                                            growth_interval=growth_interval) if precision == "fp16" else None)
        self.trainable_only = trainable_only  # with adapters (`checkpoint_weights`)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(self.scaler.scale(loss) if self.scaler is not None else loss)

    def clip(self, model: torch.nn.Module, optimizer: Any, max_norm: float, device: torch.device) -> torch.Tensor:
        if self.scaler is not None:
            self.scaler.unscale_(inner_optimizer(optimizer))
        return super().clip(model, optimizer, max_norm, device)

    def step(self, optimizer: Any) -> bool:
        """`optimizer.step()`; in fp16 through the scaler, which skips a step whose grads overflowed (False)."""
        if self.scaler is None:
            return super().step(optimizer)
        scale = self.scaler.get_scale()
        self.scaler.step(inner_optimizer(optimizer))
        self.scaler.update()
        return self.scaler.get_scale() >= scale

    def veto(self, optimizer: Any) -> None:
        if self.scaler is not None:  # `clip` unscaled this step's grads; the next unscale_ raises until an update
            self.scaler.update()

    def loss_scale(self) -> float | None:
        return self.scaler.get_scale() if self.scaler is not None else None

    def checkpoint_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The weights a checkpoint holds: all of them, or with adapters only the trainable ones. The
        frozen base is rebuilt identically on resume (loaded from `model.name_or_path`, or initialised
        from the seed), so writing it again with every checkpoint would buy nothing."""
        state = self.lm(model).state_dict()
        if not self.trainable_only:
            return state
        names = {name for name, p in self.lm(model).named_parameters() if p.requires_grad}
        return {k: v for k, v in state.items() if k in names}

    def optimizer_writer(self, optimizer: Any, run_dir: Path, step: int) -> OptimizerWriter:
        def write(tmp: Path) -> None:
            serialize.save_state(tmp / "optimizer.pt", optimizer.state_dict())
            if self.scaler is not None:
                serialize.save_state(tmp / "scaler.pt", self.scaler.state_dict())

        return write

    def load_state(self, model: torch.nn.Module, optimizer: Any, payload: dict[str, Any]) -> None:
        self.load_weights(model, payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        if self.scaler is not None and payload["scaler"] is not None:
            self.scaler.load_state_dict(payload["scaler"])

    def load_weights(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        # with adapters the frozen base is missing by design (`checkpoint_weights`); resume checked the rest
        self.lm(model).load_state_dict(weights, strict=not self.trainable_only)

