"""The step engines' one protocol (`llmexp.train.engines.base.Engine`): each engine implements all of it, none
inherits from another, and DeepSpeed's step is called a step (it clips inside it, so `clip` reports its norm).
On stand-in accelerators: nothing collective runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmexp.config.derived import BatchPlan
from llmexp.train.engines.base import Engine
from llmexp.train.engines.deepspeed import DeepSpeedEngine
from llmexp.train.engines.fsdp import FsdpEngine
from llmexp.train.engines.plain import PlainEngine

PLAN = BatchPlan(micro=4, accum=2, world=1, fixed_steps=4, epochs=1.0)


def _engines() -> list[object]:
    accelerator = SimpleNamespace(device=torch.device("cpu"))
    return [PlainEngine(accelerator, "fp32", 1.0, 1), DeepSpeedEngine(accelerator, "fp32", PLAN, 2),
            FsdpEngine(accelerator, "fp32", PLAN, "full_shard", False)]


@pytest.mark.parametrize("engine", _engines(), ids=lambda e: type(e).__name__)
def test_every_engine_implements_the_protocol_on_its_own(engine: object) -> None:
    assert isinstance(engine, Engine)
    others = {PlainEngine, DeepSpeedEngine, FsdpEngine} - {type(engine)}
    assert not any(isinstance(engine, other) for other in others), type(engine).__mro__


def test_deepspeed_steps_first_and_clip_reports_the_norm_of_that_step() -> None:
    """The loop calls `step` before `clip` under DeepSpeed (`steps_first`): the step is taken there, and a
    non-finite norm (a skipped step) reads as inf."""
    applied = {"value": True}
    ds = SimpleNamespace(step=lambda: None, get_global_grad_norm=lambda: 2.5, optimizer=SimpleNamespace(overflow=False),
                         was_step_applied=lambda: applied["value"], backward=lambda loss, scale_wrt_gas: None,
                         set_gradient_accumulation_boundary=lambda flag: None)
    engine = DeepSpeedEngine(SimpleNamespace(deepspeed_engine_wrapped=SimpleNamespace(engine=ds)), "fp32", PLAN, 2)
    assert engine.steps_first and not PlainEngine.steps_first and not FsdpEngine.steps_first
    with pytest.raises(RuntimeError, match="after 0 micro-batches, expected 2"):
        engine.step(None)
    for _ in range(PLAN.accum):
        engine.backward(torch.zeros(()))
    assert engine.step(None) is True and float(engine.clip(None, None, 1.0)) == 2.5  # type: ignore[arg-type]
    applied["value"] = False
    for _ in range(PLAN.accum):
        engine.backward(torch.zeros(()))
    assert engine.step(None) is False and float(engine.clip(None, None, 1.0)) == float("inf")  # type: ignore[arg-type]
