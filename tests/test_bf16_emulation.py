"""llmexp.model.bf16_emulation: bf16 autocast numerics with fp32 gemms, on a real (small) Llama and its fused head.

Where this CPU has native bf16 (AVX512-BF16), torch's own bf16 autocast is the reference the emulation is held to;
on an AVX2-only CPU the reference is torch's fallback bf16 gemm (these tests pass under the AVX2 reproduction of
benchmarks/bf16_cpu.py too). Each bound says what was measured on this machine. The smallest Llama that has every
part (2 layers, GQA-free sdpa attention, the fused head) keeps torch's slow bf16 arms cheap on such a CPU.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from llmexp.model.bf16_emulation import (
    EMULATION_ENV,
    Bf16Emulation,
    Bf16Probe,
    emulation_message,
    probe_bf16_slowdown,
    use_bf16_emulation,
)
from llmexp.model.loss import CausalLMLoss

aten = torch.ops.aten
SLOW_BF16_OPS = (aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_dot_product_flash_attention_for_cpu,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward)
"""The aten ops whose bf16 CPU kernel is the slow gemm on a CPU without AVX512: none may reach torch."""


class SlowBf16Ops(TorchDispatchMode):
    """Entered *outside* Bf16Emulation, it sees what the emulation passes on to torch: records bf16 gemms."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func.overloadpacket in SLOW_BF16_OPS and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _model(**overrides: Any) -> CausalLMLoss:
    torch.manual_seed(0)
    fields = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "attn_implementation": "sdpa", **overrides}
    return CausalLMLoss(LlamaForCausalLM(LlamaConfig(**fields)))


def _batches(steps: int) -> torch.Tensor:
    """Tokens from a skewed distribution (64 of 512 ids), so 12 steps of AdamW visibly lower the loss."""
    return torch.randint(0, 64, (steps, 4, 64), generator=torch.Generator().manual_seed(1))


@contextlib.contextmanager
def _precision(arm: str) -> Iterator[Bf16Emulation | None]:
    """fp32, torch's bf16 autocast, or bf16 autocast with the emulation (as the trainer would wire it)."""
    if arm == "fp32":
        yield None
        return
    with torch.autocast("cpu", torch.bfloat16):
        if arm == "bf16":
            yield None
            return
        with Bf16Emulation() as mode:
            yield mode


def _step(model: torch.nn.Module, ids: torch.Tensor, arm: str) -> float:
    with _precision(arm):
        loss = model(input_ids=ids, labels=ids) / ids.numel()
        loss.backward()
    return loss.item()


def _curve(arm: str, steps: int) -> list[float]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for ids in _batches(steps):
        losses.append(_step(model, ids, arm))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


# ------------------------------------------------------------------------------------------------ coverage
def test_a_training_step_runs_no_bf16_gemm_in_torch_and_its_grads_are_bf16_rounded() -> None:
    """Forward, fused head and backward: every bf16 gemm and attention kernel is replaced (none reaches torch's slow
    bf16 kernels), and every weight gradient is exactly a bf16 value: the gradients were rounded on the way back."""
    model = _model()
    ids = _batches(1)[0]
    slow = SlowBf16Ops()
    with torch.autocast("cpu", torch.bfloat16), slow, Bf16Emulation() as mode:
        loss = model(input_ids=ids, labels=ids)
        loss.backward()
    assert slow.seen == []
    # 2 layers x (7 linears + attention) forward, their backward (2 gemms each, 1 attention), head fwd + 2 grads
    assert mode.calls >= 2 * 8 * 2 + 3
    for name, p in model.named_parameters():
        if p.dim() == 2 and "embed" not in name:  # the matmul weights: their grads come from bf16 gemms
            assert torch.equal(p.grad, p.grad.to(torch.bfloat16).to(p.grad.dtype)), name  # bf16 values
    assert torch.isfinite(loss)


def test_without_the_emulation_torch_runs_its_own_bf16_gemms() -> None:
    """The control for the test above: the checker does see bf16 gemms when the emulation is absent, or has ended."""
    model = _model()
    ids = _batches(1)[0]
    mode = Bf16Emulation()
    with mode:
        pass
    slow = SlowBf16Ops()
    with torch.autocast("cpu", torch.bfloat16), slow:
        model(input_ids=ids, labels=ids).backward()
    assert mode.calls == 0
    assert any("mm" in op for op in slow.seen) and any("flash_attention" in op for op in slow.seen)


def test_a_gemm_matches_torch_bf16_bitwise_but_for_rare_accumulation_ties() -> None:
    """Exact products of bf16 operands, fp32 accumulation, one rounding: a native bf16 gemm's result. Only the
    accumulation order differs (measured: 99.99% of outputs bitwise equal); fp32 matches none."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 128, generator=gen), torch.randn(96, 128, generator=gen)
    with torch.autocast("cpu", torch.bfloat16):
        reference = F.linear(x, w)
        with Bf16Emulation():
            emulated = F.linear(x, w)
    assert emulated.dtype == torch.bfloat16
    assert (emulated == reference).float().mean() > 0.999
    assert (F.linear(x, w).bfloat16() == reference).float().mean() < 0.9  # fp32 differs: the test can tell


def _attention_inputs(kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, 16, generator=gen)
    k, v = (torch.randn(2, kv_heads, 24, 16, generator=gen) for _ in range(2))
    return q, k, v


def _attend(inputs: Sequence[torch.Tensor], dtype: torch.dtype, emulate: bool, mask: torch.Tensor | None = None,
            repeat_kv: bool = False) -> tuple[torch.Tensor, ...]:
    """SDPA forward and backward; `repeat_kv` repeats grouped kv heads before SDPA rather than in it."""
    leaves = [t.to(dtype).detach().requires_grad_() for t in inputs]
    query, key, value = leaves
    groups = query.shape[1] // key.shape[1]
    if repeat_kv:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    with Bf16Emulation() if emulate else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=key.shape[1] != query.shape[1])
        out.backward(torch.ones_like(out))
    return (out, *(t.grad for t in leaves))


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("masked", [False, True])
def test_attention_matches_torch_bf16_kernel(masked: bool) -> None:
    """The flash kernel emulated, forward and backward, causal or with a padding mask (a fully masked row
    included): within bf16 rounding of torch's own bf16 kernel, and much closer to it than fp32 attention is
    (measured: 0.2x for the output and each gradient).

    24 queries: one block of torch's kernel. From 32 queries on it re-rounds its dK and dV accumulators to bf16
    after each block of queries, where the emulation, like a GPU's flash attention, accumulates in fp32."""
    inputs = _attention_inputs(kv_heads=4)
    mask = None
    if masked:
        mask = torch.ones(2, 1, 24, 24, dtype=torch.bool).tril()
        mask[1, :, 5] = False  # a query that sees nothing: the kernel gives zeros
        mask[0, :, :, 20:] = False  # padded keys
    reference = _attend(inputs, torch.bfloat16, emulate=False, mask=mask)
    emulated = _attend(inputs, torch.bfloat16, emulate=True, mask=mask)
    fp32 = _attend(inputs, torch.float32, emulate=False, mask=mask)
    for ref, emu, full in zip(reference, emulated, fp32, strict=True):
        assert emu.dtype == torch.bfloat16
        assert _distance(emu, ref) < 0.4 * _distance(full, ref)
    if masked:
        assert torch.equal(emulated[0][1, :, 5], reference[0][1, :, 5])


def test_grouped_query_attention_shares_each_kv_head() -> None:
    """GQA in the kernel (kv heads shared by 2 query heads) is the same attention as with the kv heads repeated:
    the same output and dQ, and dK, dV the sums over each group (rounded once, not per head: hence not bitwise)."""
    inputs = _attention_inputs(kv_heads=2)
    grouped = _attend(inputs, torch.bfloat16, emulate=True)
    repeated = _attend(inputs, torch.bfloat16, emulate=True, repeat_kv=True)
    assert torch.equal(grouped[0], repeated[0]) and torch.equal(grouped[1], repeated[1])
    for g, r in zip(grouped[2:], repeated[2:], strict=True):
        assert _distance(g, r) < 1e-2


def test_attention_in_chunks_of_queries_is_the_same_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long sequences are emulated a chunk of query rows at a time (bounded memory): the same result as at once."""
    import llmexp.model.bf16_emulation as emulation

    inputs = _attention_inputs(kv_heads=2)
    whole = _attend(inputs, torch.bfloat16, emulate=True)
    monkeypatch.setattr(emulation, "ATTENTION_CHUNK_VALUES", 2 * 4 * 24 * 5)  # 5 query rows a chunk
    chunked = _attend(inputs, torch.bfloat16, emulate=True)
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])  # output, dQ: row by row
    for w, c in zip(whole[2:], chunked[2:], strict=True):  # dK, dV: summed over the chunks in fp32
        assert _distance(c, w) < 1e-3


# ------------------------------------------------------------------------------------------------ numerics in training
def test_losses_and_gradients_track_torch_bf16_autocast() -> None:
    """12 AdamW steps: the emulated curve stays near torch's bf16 autocast (measured: 3.3e-4 at most, 1.4e-4 on
    average, against fp32's 8.4e-4 and 3.1e-4), and the first step's gradients are closer to bf16 autocast's than
    fp32's are (measured: 0.64x). Exact agreement is not to be had: two bf16 kernels that differ only in their
    accumulation order drift apart as far (torch's own bf16 on an AVX2-only CPU's kernel: 0.58x fp32's)."""
    curves = {arm: _curve(arm, steps=12) for arm in ("fp32", "bf16", "emul")}
    assert curves["bf16"][-1] < curves["bf16"][0] - 1.0  # the curve is real: it learns
    gaps = {arm: [abs(a - b) for a, b in zip(curves[arm], curves["bf16"], strict=True)] for arm in ("fp32", "emul")}
    assert max(gaps["emul"]) < 1.5e-3
    assert sum(gaps["emul"]) < 0.8 * sum(gaps["fp32"]), gaps
    grads = {}
    ids = _batches(1)[0]
    for arm in ("fp32", "bf16", "emul"):
        model = _model()
        _step(model, ids, arm)
        grads[arm] = _grads(model)
    distance = {arm: _distance(grads[arm], grads["bf16"]) for arm in ("fp32", "emul")}
    assert distance["emul"] < 0.85 * distance["fp32"], distance


def test_gradient_checkpointing_recomputes_inside_the_emulation() -> None:
    """Checkpointed layers recompute their forward during backward: inside the context the recomputation is emulated
    too (else a non-reentrant checkpoint would see other saved tensors), and the grads equal the plain run's bitwise."""
    ids = _batches(1)[0]
    plain, checkpointed = _model(), _model()
    checkpointed.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed.train()
    for model in (plain, checkpointed):
        _step(model, ids, "emul")
    assert torch.equal(_grads(plain), _grads(checkpointed))


def test_lora_on_a_bf16_base_is_emulated() -> None:
    """peft: a frozen base held in bf16 (as llmexp's lora does), fp32 adapters: no bf16 gemm reaches torch."""
    from peft import LoraConfig, get_peft_model

    model = _model()
    model.lm = get_peft_model(model.lm.to(torch.bfloat16), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    ids = _batches(1)[0]
    slow = SlowBf16Ops()
    with torch.autocast("cpu", torch.bfloat16), slow, Bf16Emulation() as mode:
        model(input_ids=ids, labels=ids).backward()
    assert slow.seen == [] and mode.calls > 0
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None and torch.isfinite(g).all() for g in lora_grads)


def test_inference_mode_and_no_grad_are_emulated() -> None:
    """Under inference_mode, composite ops (matmul, linear, SDPA) reach the mode whole: it decomposes them."""
    model = _model()
    ids = _batches(1)[0]
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", torch.bfloat16):
        with torch.no_grad(), Bf16Emulation():
            no_grad = model(input_ids=ids, labels=ids)
        slow = SlowBf16Ops()
        with torch.inference_mode(), slow, Bf16Emulation() as mode:
            inference = reference(input_ids=ids, labels=ids)
    assert slow.seen == [] and mode.calls > 0
    assert torch.equal(no_grad, inference)


# ------------------------------------------------------------------------------------------------ probe and decision
def test_probe_measures_positive_factors() -> None:
    probe = probe_bf16_slowdown(size=128, budget_s=0.05)
    assert 0 < probe.native_slowdown < 1e3 and 0 < probe.emulated_slowdown < 1e3
    assert probe.seconds > 0
    assert "x fp32's" in emulation_message(probe, emulating=True)


@pytest.mark.parametrize(("precision", "device", "support", "probe", "env", "expected"), [
    ("bf16", "cpu", "emulated", None, None, True),
    ("bf16", "cpu", "emulated", Bf16Probe(25.0, 1.2, 0.1), None, True),
    ("bf16", "cpu", "emulated", Bf16Probe(0.9, 1.2, 0.1), None, False),  # torch's bf16 is the faster here
    ("bf16", "cpu", "native", None, None, False),
    ("fp32", "cpu", "emulated", None, None, False),
    ("bf16", "cuda", "emulated", None, None, False),
    ("bf16", "cpu", "native", None, "1", True),
    ("bf16", "cpu", "emulated", None, "0", False),
    ("fp32", "cpu", "emulated", None, "1", False),
])
def test_decision(monkeypatch: pytest.MonkeyPatch, precision: str, device: str, support: str,
                  probe: Bf16Probe | None, env: str | None, expected: bool) -> None:
    if env is None:
        monkeypatch.delenv(EMULATION_ENV, raising=False)
    else:
        monkeypatch.setenv(EMULATION_ENV, env)
    assert use_bf16_emulation(precision, device, support, probe) is expected
