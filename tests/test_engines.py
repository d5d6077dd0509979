"""The step engines' one protocol (`llmexp.train.engines.base.Engine`, an abstract base with the shared defaults):
each engine answers all of it, none inherits from another engine, and DeepSpeed's step is called a step (it clips
inside it, so `clip` reports its norm).
On stand-in accelerators: nothing collective runs.

The loss lives on the accelerator, the gradients (FSDP's CPU offload) or the norm (DeepSpeed's float) may not: the
contract tests put the loss on the meta device and the gradients on the CPU, so that a norm returned on the wrong
device fails here, on a CPU, as it would on the first step on a GPU."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from llmexp.config.derived import BatchPlan
from llmexp.train.engines.base import Engine
from llmexp.train.engines.deepspeed import DeepSpeedEngine
from llmexp.train.engines.fsdp import FsdpEngine
from llmexp.train.engines.plain import PlainEngine

PLAN = BatchPlan(micro=4, accum=2, world=1, fixed_steps=4, epochs=1.0)
CPU, META = torch.device("cpu"), torch.device("meta")


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
    assert engine.step(None) is True and float(engine.clip(None, None, 1.0, CPU)) == 2.5  # type: ignore[arg-type]
    applied["value"] = False
    for _ in range(PLAN.accum):
        engine.backward(torch.zeros(()))
    assert engine.step(None) is False and float(engine.clip(None, None, 1.0, CPU)) == float("inf")  # type: ignore[arg-type]


def _stand_in_deepspeed(norm: float) -> SimpleNamespace:
    ds = SimpleNamespace(step=lambda: None, get_global_grad_norm=lambda: norm,
                         optimizer=SimpleNamespace(overflow=False), was_step_applied=lambda: True,
                         backward=lambda loss, scale_wrt_gas: None,
                         set_gradient_accumulation_boundary=lambda flag: None)
    return SimpleNamespace(deepspeed_engine_wrapped=SimpleNamespace(engine=ds), device=CPU)


def _engine_with_cpu_grads(kind: str) -> tuple[object, torch.nn.Module, torch.optim.Optimizer]:
    """An engine, a model whose gradients are on the CPU, and its optimizer, each as the loop holds them."""
    model = torch.nn.Linear(4, 3)
    model(torch.ones(2, 4)).sum().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = SimpleNamespace(device=CPU, clip_grad_norm_=torch.nn.utils.clip_grad_norm_)
    engine: object = {"plain": lambda: PlainEngine(accelerator, "fp32", 1.0, 1),
                      "deepspeed": lambda: DeepSpeedEngine(_stand_in_deepspeed(3.5), "fp32", PLAN, 2),
                      "fsdp": lambda: FsdpEngine(accelerator, "fp32", PLAN, "full_shard", True)}[kind]()
    return engine, model, optimizer


@pytest.mark.parametrize("kind", ["plain", "deepspeed", "fsdp"])
def test_clip_returns_the_norm_on_the_loss_device(kind: str) -> None:
    """The loop's step (`train.py`): the norm is stacked with the loss for one host read. The loss on the meta device
    and the gradients on the CPU stand for a CUDA loss beside CPU gradients (FSDP's offload) or DeepSpeed's float
    norm: stacking a norm left on the CPU raises, as the first DeepSpeed step on a GPU did."""
    engine, model, optimizer = _engine_with_cpu_grads(kind)
    loss_sum = torch.zeros((), device=META)
    assert isinstance(engine, Engine)
    if engine.steps_first:
        for _ in range(PLAN.accum):
            engine.backward(loss_sum)
        assert engine.step(optimizer) is True
    norm = engine.clip(model, optimizer, 1.0, loss_sum.device)
    assert norm.device == META and norm.shape == ()
    assert torch.stack([loss_sum / 4, norm.float().reshape(())]).device == META  # the loop's one host read
    if not engine.steps_first:
        assert engine.step(optimizer) is True
    cpu_norm = engine.clip(model, optimizer, 0.0, CPU)  # and on the CPU it is the norm itself
    assert cpu_norm.device == CPU and math.isfinite(float(cpu_norm)) and float(cpu_norm) > 0


def test_fsdp_cpu_offload_opens_a_group_that_carries_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """fsdp.cpu_offload=true on CUDA: the grad norm is reduced on the CPU, which NCCL cannot do. The default group of a
    plain `python -m llmexp` and the mesh's groups (under torchrun Accelerate has opened an NCCL-only default
    group) are `cuda:nccl,cpu:gloo`; without offload, NCCL alone as before. CUDA is patched in: nothing is opened."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh

    from llmexp.train.engines import fsdp

    opened: list[str] = []
    meshes: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: opened.append(backend))
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda *a, **kw: meshes.append(kw.get("backend_override")))
    monkeypatch.setattr("llmexp.train.distributed.single_process_env", lambda: None)
    for offload in (True, False):
        fsdp.ensure_process_group(offload)
        for strategy in ("full_shard", "hybrid_shard"):
            accelerator = SimpleNamespace(device=torch.device("cuda"))
            FsdpEngine(accelerator, "bf16", PLAN, strategy, offload)._mesh()
    assert opened == ["cuda:nccl,cpu:gloo", "nccl"]
    both = "cuda:nccl,cpu:gloo"
    assert meshes == [{"shard": both}, {"replicate": both, "shard": both}, None, None]


def test_tf32_is_set_on_the_cuda_backends_alone() -> None:
    """Issue 41, item 3: `precision.tf32` sets CUDA's fp32 matmuls and convolutions to TF32 (or IEEE), and leaves
    oneDNN's CPU matmuls as they were (`torch.set_float32_matmul_precision` would reach them too)."""
    from llmexp.train.runtime import use_tf32

    before = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision,
              torch.backends.mkldnn.matmul.fp32_precision)
    try:
        use_tf32(True)
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("tf32",
                                                                                                         "tf32")
        use_tf32(False)
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("ieee",
                                                                                                         "ieee")
        assert torch.backends.mkldnn.matmul.fp32_precision == before[2]
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before[:2]
