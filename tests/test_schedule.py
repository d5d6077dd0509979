"""The lr schedule is a pure function of the step; lr=auto follows the seed's table."""

from __future__ import annotations

import itertools
import math

import pytest

from llmexp.train.schedule import auto_lr, lr_at, warmup_steps_for


def test_cosine_warms_up_then_decays_to_min() -> None:
    kw = {"name": "cosine", "peak_lr": 1e-3, "max_steps": 100, "warmup_steps": 10, "min_lr_ratio": 0.1}
    assert lr_at(0, **kw) == pytest.approx(1e-4)
    assert lr_at(9, **kw) == pytest.approx(1e-3)
    assert lr_at(10, **kw) == pytest.approx(1e-3)
    assert lr_at(55, **kw) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, **kw) == pytest.approx(1e-4)
    values = [lr_at(s, **kw) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_linear_constant_and_wsd() -> None:
    base = {"peak_lr": 1.0, "max_steps": 100, "warmup_steps": 0}
    assert lr_at(50, name="linear", min_lr_ratio=0.0, **base) == pytest.approx(0.5)
    assert lr_at(99, name="constant", **base) == 1.0
    wsd = {"name": "wsd", "decay_ratio": 0.2, "min_lr_ratio": 0.0, **base}
    assert lr_at(79, **wsd) == 1.0
    assert lr_at(90, **wsd) == pytest.approx(0.5)
    assert lr_at(100, **wsd) == pytest.approx(0.0)


def test_warmup_steps_win_over_ratio() -> None:
    assert warmup_steps_for(100, 0.05, None) == 5
    assert warmup_steps_for(100, 0.05, 7) == 7


@pytest.mark.parametrize(("params", "lr"), [(6.8e6, 3e-4), (1.5e9, 2e-4), (13e9, 1e-4), (175e9, 7e-5)])
def test_auto_lr_follows_the_seeds_table(params: float, lr: float) -> None:
    assert auto_lr(int(params), finetune=False) == lr
    assert auto_lr(int(params), finetune=True) == pytest.approx(lr / 10)
