"""llmexp.model.cpu_matmul (fp32 CPU matmuls through oneDNN, decided by a probe) and llmexp.model.lora_dropout (LoRA's
dropout mask from 16-bit random numbers): the same numbers as torch's own path, the fallbacks, and where a run
takes which path."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from llmexp.model import cpu_matmul
from llmexp.model.lora_dropout import MaskDropout, use_mask_dropout
from llmexp.model.loss import CausalLMLoss, LinearCrossEntropy
from tests.conftest import compose, tiny_llama

needs_op = pytest.mark.skipif(cpu_matmul._op() is None, reason="this torch build has no mkldnn._linear_pointwise")


def _loss_and_grads(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (4, 32), generator=gen)
    total = model(ids, ids)
    (total / 100).backward()
    return float(total), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@needs_op
def test_a_routed_linear_equals_f_linear_forward_and_backward() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 48, generator=gen, requires_grad=True)
    w = torch.randn(40, 48, generator=gen, requires_grad=True)
    b = torch.randn(40, generator=gen, requires_grad=True)
    dy = torch.randn(3, 5, 40, generator=gen)
    ours = cpu_matmul.linear(x, w, b)
    grads = torch.autograd.grad(ours, (x, w, b), dy)
    ref = F.linear(x, w, b)
    ref_grads = torch.autograd.grad(ref, (x, w, b), dy)
    assert ours.grad_fn is not None and "Linear" in type(ours.grad_fn).__name__  # it did take oneDNN's path
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@needs_op
@pytest.mark.parametrize("peft", [False, True])
def test_a_routed_model_trains_as_torch_does(peft: bool) -> None:
    """Every nn.Linear (peft's base layers and adapters too) and the fused head's matmuls through oneDNN: the loss
    and every gradient equal torch's path to fp32 rounding; parameters and state_dict are untouched."""
    lm = tiny_llama()
    if peft:
        from peft import LoraConfig, get_peft_model

        lm = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
        for name, p in lm.named_parameters():  # B = 0 at init would leave A's gradient zero: a test of nothing
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    ref_model, ours_model = CausalLMLoss(copy.deepcopy(lm)), CausalLMLoss(copy.deepcopy(lm))
    keys = list(ours_model.state_dict())
    routed = cpu_matmul.route(ours_model.lm)
    ours_model.head_mm_t = cpu_matmul.mm_t
    assert routed == (2 * 7 * 3 + 1 if peft else 2 * 7 + 1)  # q k v o gate up down (+ A, B), the head
    assert list(ours_model.state_dict()) == keys
    ref_loss, ref_grads = _loss_and_grads(ref_model)
    ours_loss, ours_grads = _loss_and_grads(ours_model)
    assert ours_loss == pytest.approx(ref_loss, rel=1e-5)
    assert ours_grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert (ours_grads[name] - ref).abs().max() <= 1e-4 * ref.abs().max() + 1e-7, name


@needs_op
def test_the_fused_head_through_onednn_equals_cross_entropy() -> None:
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(37, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=gen)
    total = LinearCrossEntropy.apply(hidden, weight, targets, torch.float32, True, cpu_matmul.mm_t)
    grads = torch.autograd.grad(total * 0.5, (hidden, weight))
    ref = F.cross_entropy(hidden @ weight.t(), targets, reduction="sum")
    ref_grads = torch.autograd.grad(ref * 0.5, (hidden, weight))
    assert float(total) == pytest.approx(float(ref), rel=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_off_the_path_a_routed_linear_is_f_linear() -> None:
    """bf16 tensors, autocast and 1-D inputs take torch's own op: the routing is checked at every call."""
    layer = torch.nn.Linear(8, 4)
    cpu_matmul.route(layer)
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    assert not cpu_matmul.applies(x.bfloat16(), layer.weight) and not cpu_matmul.applies(x[0], layer.weight)
    torch.testing.assert_close(layer(x[0]), F.linear(x[0], layer.weight, layer.bias))


def test_the_verdict_is_probed_once_per_machine_and_a_damaged_cache_is_probed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Two runs on one machine take the same path (a timing near the threshold would otherwise flip it, and the
    losses' last bits with it); a cache that is not the probe's verdicts is a miss, with one info line."""
    faster = cpu_matmul.MatmulPath("onednn", "1.3x", 1.3, 1e-7)
    slower = cpu_matmul.MatmulPath("torch", "1.1x", 1.1, 1e-7)
    verdicts = iter([faster, slower])
    monkeypatch.setattr(cpu_matmul, "probe", lambda *shape: next(verdicts))
    cache = tmp_path / "cpu_matmul.json"
    first = cpu_matmul.probe_once(cache, 256, 64, 128)
    assert first.onednn and cpu_matmul.probe_once(cache, 256, 64, 128) == first  # the second probe never ran
    cache.write_text('{"k": {"path": "gpu"}}')
    with caplog.at_level("INFO", logger="llmexp.readers"):
        assert not cpu_matmul.probe_once(cache, 256, 64, 128).onednn  # probed again: the second verdict
    assert [r.getMessage() for r in caplog.records] == [f"llmexp: {cache}: k has no reason; the matmul path is "
                                                        "probed again"]


@needs_op
def test_the_probe_measures_and_checks_both_paths() -> None:
    path = cpu_matmul.probe(64, 96, 128)
    assert path.path in ("onednn", "torch") and path.speedup is not None and path.speedup > 0
    assert path.max_rel_diff is not None and path.max_rel_diff <= cpu_matmul.MAX_REL_DIFF
    assert "a 64 x 96 x 128 matmul" in path.reason and "torch's speed" in path.reason, path.reason
    assert path.onednn == (path.speedup >= cpu_matmul.MIN_SPEEDUP)
    assert path.record()["path"] == path.path


def test_without_the_op_the_probe_keeps_torchs_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_matmul, "_op", lambda: None)
    path = cpu_matmul.probe(64, 96, 128)
    assert path.path == "torch" and "_linear_pointwise is not in torch" in path.reason
    assert path.matmul_t() is cpu_matmul.torch_mm_t


def test_results_that_disagree_keep_torchs_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_matmul, "_op", lambda: object())
    monkeypatch.setattr(cpu_matmul, "mm_t", lambda a, b: (a @ b.t()) * 1.001)
    path = cpu_matmul.probe(64, 96, 128)
    assert path.path == "torch" and "differs from torch's by 1.0e-03" in path.reason


def _runtime(precision: str = "fp32", device: str = "cpu") -> Any:
    return SimpleNamespace(device=torch.device(device), precision=SimpleNamespace(name=precision))


@pytest.mark.parametrize(("overrides", "precision", "expected"), [
    ([], "fp32", "probe"),
    (["train.cpu_matmul=torch"], "fp32", "train.cpu_matmul=torch"),
    (["train.compile=true"], "fp32", "train.compile=true: inductor chooses the kernels"),
    (["fsdp=full_shard"], "fp32", "fsdp=full_shard wraps the layers"),
    ([], "bf16", None),
])
def test_where_a_run_takes_which_path(overrides: list[str], precision: str, expected: str | None,
                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmexp.train.setup import cpu_matmul_path

    monkeypatch.setattr(cpu_matmul, "probe",
                        lambda rows, k, n: cpu_matmul.MatmulPath("onednn", f"probe {rows} {k} {n}"))
    cfg = compose(["precision=fp32", f"data.cache_dir={tmp_path / 'cache'}", *overrides], tmp_path)  # no verdict yet
    path = cpu_matmul_path(cfg, _runtime(precision), tiny_llama(), 512)
    if expected is None:
        assert path is None  # bf16: autocast runs on oneDNN already, and the emulation owns its matmuls
    elif expected == "probe":
        assert path is not None and path.reason == "probe 512 64 128"  # the widest linear but the head: gate_proj
    else:
        assert path is not None and path.path == "torch" and path.reason == expected


def test_mask_dropout_drops_p_of_the_values_and_keeps_the_expectation() -> None:
    torch.manual_seed(0)
    drop = MaskDropout(0.25)
    x = torch.ones(400, 500, requires_grad=True)
    y = drop(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.005
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.75))
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(grad, y.detach())  # d y / d x is the scaled mask
    rows = kept.float().mean(1)
    assert rows.std().item() < 0.05  # not one mask value repeated along a row
    drop.eval()
    assert torch.equal(drop(x), x)


def test_mask_dropout_replaces_every_lora_dropout_and_repeats_with_the_seed() -> None:
    from peft import LoraConfig, get_peft_model

    lm = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear"))
    assert use_mask_dropout(lm) == 2 * 7
    drops = [d for m in lm.modules() if isinstance(getattr(m, "lora_dropout", None), torch.nn.ModuleDict)
             for d in m.lora_dropout.values()]
    assert len(drops) == 14 and all(type(d) is MaskDropout and d.p == 0.1 for d in drops)
    x = torch.randn(64, 64)
    torch.manual_seed(3)
    first = drops[0](x)
    torch.manual_seed(3)
    assert torch.equal(drops[0](x), first)  # torch's generator: a checkpoint's RNG state repeats the masks
