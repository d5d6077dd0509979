"""Side computations on a model that must leave no trace: the lr range test (`train.lr_find`), samples
(`train.samples`) and lm-evaluation-harness tasks (`evals.harness`) draw from generators, and the run after them
must be bitwise the run without them; an eval leaves the model in the mode it found it in."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def rng_untouched(device: torch.device) -> Iterator[None]:
    """Every RNG the run draws from is as it was before (python, numpy, torch CPU and the device's)."""
    py_state, np_state = random.getstate(), np.random.get_state()
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode for the block, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
