"""The lr schedule is a pure function of the step; lr=auto follows the seed's table."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmexp.config.derived import warmup_problem, warmup_steps_for
from llmexp.train.schedule import auto_lr, lr_at
from tests.conftest import TINY, run_cli


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


@pytest.mark.parametrize(("overrides", "says"), [
    (["train.max_steps=4", "train.warmup_ratio=0.9"],
     "train.warmup_ratio: warmup (4 steps) must be shorter than train.max_steps=4"),
    (["train.max_steps=1000", "train.warmup_ratio=0.9995"],
     "train.warmup_ratio: warmup (1000 steps) must be shorter than train.max_steps=1000"),
    (["train.max_steps=4", "train.warmup_steps=4"],
     "train.warmup_steps: warmup (4 steps) must be shorter than train.max_steps=4"),
], ids=["ratio_rounded_up", "ratio_of_a_long_run", "steps"])
def test_a_warmup_as_long_as_the_run_is_refused_as_the_schedule_rounds_it(tmp_path: Path, overrides: list[str],
                                                                         says: str) -> None:
    """The check rounds a ratio as the trainer does (up): 0.9 of 4 steps is 4 steps of warm-up, no decay."""
    proc = run_cli([*TINY, *overrides, f"hydra.run.dir={tmp_path / 'run'}"], timeout_s=120)
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_wsd_warmup_running_into_its_decay_is_refused_naming_both_keys(tmp_path: Path) -> None:
    """wsd decays over the last scheduler.decay_ratio of the steps; a warm-up into that stretch would be clipped."""
    proc = run_cli([*TINY, "scheduler=wsd", "train.max_steps=10", "train.warmup_steps=9", "scheduler.decay_ratio=0.2",
                    f"hydra.run.dir={tmp_path / 'run'}"], timeout_s=120)
    says = ("train.warmup_steps: warmup (9 steps) plus wsd's decay (2 steps, scheduler.decay_ratio=0.2) must fit in "
            "train.max_steps=10; lower train.warmup_steps/warmup_ratio or scheduler.decay_ratio or raise "
            "train.max_steps")
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_wsd_warmup_that_ends_where_the_decay_begins_is_accepted() -> None:
    train = SimpleNamespace(warmup_ratio=0.0, warmup_steps=8, max_steps=10)
    wsd = SimpleNamespace(name="wsd", decay_ratio=0.2)
    assert warmup_problem(train, wsd, 10, "train.max_steps=10") is None  # steps 0-7 warm up, 8-9 decay
    assert warmup_problem(train, wsd, 9, "train.max_steps=9") is not None
    assert warmup_problem(train, SimpleNamespace(name="cosine", decay_ratio=0.2), 9, "train.max_steps=9") is None


def test_an_epoch_run_shorter_than_its_warmup_exits_2_naming_the_key(tmp_path: Path) -> None:
    """train.max_steps=-1: the step count is known once the data is; a warm-up that outlasts it is refused then."""
    proc = run_cli([*TINY, "train.max_steps=-1", "data.max_examples=16", "train.warmup_steps=100000",
                    f"hydra.run.dir={tmp_path / 'run'}"], timeout_s=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    says = "train.warmup_steps: warmup (100000 steps) must be shorter than the run's"
    assert says in proc.stderr, proc.stderr[-2000:]
    assert "raise train.num_train_epochs" in proc.stderr
