"""llmexp.model.loss: the fused linear + cross-entropy head against autograd's path on a real tiny Llama."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

import llmexp.model.loss as loss_lib
from llmexp.model.loss import CausalLMLoss, LinearCrossEntropy
from tests.conftest import tiny_llama


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 512, (4, 64), generator=gen)
    labels = input_ids.clone()
    labels[0, :20] = -100  # rows with different numbers of targets (SFT-style)
    labels[2, 50:] = -100
    return input_ids, labels


def _reference_sum(lm: LlamaForCausalLM, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF logits, then fp32 cross-entropy summed over the targets (what the head must equal)."""
    logits = lm(input_ids=input_ids).logits[:, :-1]
    targets = labels[:, 1:]
    keep = targets != -100
    return F.cross_entropy(logits[keep].float(), targets[keep], reduction="sum")


def _loss_and_grads(fn: object, lm: LlamaForCausalLM, dtype: torch.dtype) -> tuple[float, list[torch.Tensor]]:
    input_ids, labels = _batch()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        total = fn(lm, input_ids, labels)
    (total / 100.0).backward()
    return float(total.detach()), [p.grad.clone() for p in lm.parameters()]


@pytest.mark.parametrize("chunk_tokens", [4096, 50])  # one chunk; several chunks with a ragged last one
def test_fused_head_equals_autograd_in_fp32(chunk_tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_lib, "CHUNK_TOKENS", chunk_tokens)
    lm = tiny_llama(num_attention_heads=2)
    ref_loss, ref_grads = _loss_and_grads(_reference_sum, copy.deepcopy(lm), torch.float32)
    ours_loss, ours_grads = _loss_and_grads(lambda m, x, y: CausalLMLoss(m)(x, y), copy.deepcopy(lm), torch.float32)
    assert ours_loss == pytest.approx(ref_loss, rel=1e-6)
    for ref, ours in zip(ref_grads, ours_grads, strict=True):
        assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-7)


def test_fused_head_under_bf16_autocast_matches_to_bf16_precision() -> None:
    lm = tiny_llama(num_attention_heads=2)
    ref_loss, ref_grads = _loss_and_grads(_reference_sum, copy.deepcopy(lm), torch.bfloat16)
    ours_loss, ours_grads = _loss_and_grads(lambda m, x, y: CausalLMLoss(m)(x, y), copy.deepcopy(lm),
                                            torch.bfloat16)
    assert ours_loss == pytest.approx(ref_loss, rel=1e-5)  # both: fp32 CE of the same bf16 logits
    for ref, ours in zip(ref_grads, ours_grads, strict=True):
        assert (ours - ref).abs().max() <= 2 * 2**-8 * ref.abs().max()  # within a bf16 ulp or two
        assert ours.dtype == torch.float32


def test_no_grad_forward_gives_the_same_loss_and_keeps_nothing() -> None:
    lm = tiny_llama(num_attention_heads=2)
    input_ids, labels = _batch()
    with torch.no_grad():
        eval_loss = CausalLMLoss(lm)(input_ids, labels)
        ref = _reference_sum(lm, input_ids, labels)
    assert float(eval_loss) == pytest.approx(float(ref), rel=1e-6)
    assert not eval_loss.requires_grad


def _matmuls(fn: Any) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::mm")


def test_eval_forward_does_not_compute_the_heads_gradients() -> None:
    """Under no_grad the fused head must skip d loss / d hidden and d loss / d weight (two matmuls per chunk)."""
    model = CausalLMLoss(tiny_llama(num_attention_heads=2))
    input_ids, labels = _batch()
    with torch.no_grad():
        eval_mms = _matmuls(lambda: model(input_ids, labels))
    train_mms = _matmuls(lambda: model(input_ids, labels))
    assert train_mms - eval_mms == 2, (train_mms, eval_mms)


def test_far_off_predictions_stay_finite_and_exact() -> None:
    """A target logit 200 below the rest: the softmax underflows, the loss must not."""
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    weight = torch.tensor([[-100.0, 0.0], [100.0, 0.0], [0.0, 1.0]], requires_grad=True)
    targets = torch.tensor([0, 2])
    total = LinearCrossEntropy.apply(hidden, weight, targets, torch.float32, True)
    ref = F.cross_entropy(hidden @ weight.t(), targets, reduction="sum")
    assert torch.isfinite(total) and float(total) == pytest.approx(float(ref), rel=1e-6)
    total.backward()
    ref_h, ref_w = torch.autograd.grad(F.cross_entropy(hidden @ weight.t(), targets, reduction="sum"),
                                       [hidden, weight])
    # atol: a gradient of ~0 next to ones of 200 is float32 rounding (+-1e-6), and its sign varies by CPU kernel
    assert torch.allclose(hidden.grad, ref_h, atol=1e-5) and torch.allclose(weight.grad, ref_w, atol=1e-5)


def _nan_where_no_target(labels: torch.Tensor) -> Any:
    """A forward hook on the decoder: NaN (and one inf) in the hidden states of the positions without a target."""
    no_target = F.pad(labels[:, 1:], (0, 1), value=-100) == -100

    def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
        poison = torch.full_like(output.last_hidden_state, float("nan"))
        poison[0, 0] = float("inf")
        output.last_hidden_state = output.last_hidden_state.where(~no_target[..., None], poison)
        return output
    return hook


@pytest.mark.parametrize("chunk_tokens", [4096, 64])  # one chunk; one a row
@pytest.mark.parametrize("fused", [True, False])  # the fused head; autograd's path (fp16, a bias, ZeRO-3)
def test_rows_without_a_target_add_exactly_zero_even_when_their_hidden_state_is_nan(
        chunk_tokens: int, fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head keeps every position (fixed shapes): one without a target must add 0 to the loss and to every
    gradient also where its hidden state is NaN or inf (0 * NaN is NaN: it is masked with where())."""
    monkeypatch.setattr(loss_lib, "CHUNK_TOKENS", chunk_tokens)
    if not fused:
        monkeypatch.setattr(loss_lib, "_compute_dtype", lambda hidden, head: None)
    lm = tiny_llama(num_attention_heads=2)
    ref_loss, ref_grads = _loss_and_grads(_reference_sum, copy.deepcopy(lm), torch.float32)
    poisoned = copy.deepcopy(lm)
    poisoned.model.register_forward_hook(_nan_where_no_target(_batch()[1]))
    ours_loss, ours_grads = _loss_and_grads(lambda m, x, y: CausalLMLoss(m)(x, y), poisoned, torch.float32)
    assert ours_loss == pytest.approx(ref_loss, rel=1e-6)
    for ref, ours in zip(ref_grads, ours_grads, strict=True):
        assert torch.isfinite(ours).all() and torch.allclose(ours, ref, rtol=1e-4, atol=1e-7)


def test_the_loss_head_is_one_graph_for_torch_compile() -> None:
    """No boolean compaction of the target rows: torch.compile sees no data-dependent shape and breaks no graph."""
    input_ids, labels = _batch()
    explained = torch._dynamo.explain(CausalLMLoss(tiny_llama(num_attention_heads=2)))(input_ids, labels)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_a_right_padded_batch_needs_no_mask_and_reaches_attention_without_one() -> None:
    """Padded rows (data_mode `padded`) come without an attention_mask (issue 41, item 3): padding sits after each
    row's tokens, so causal attention already hides it and its targets are -100. The loss and every gradient equal
    those with the mask, and the blocks see no materialised mask (SDPA's causal, flash-class path on a GPU)."""
    lm = tiny_llama()
    gen = torch.Generator().manual_seed(2)
    lengths = torch.tensor([64, 40, 23, 51])
    real = torch.arange(64) < lengths[:, None]
    input_ids = torch.randint(0, 512, (4, 64), generator=gen).where(real, 0)
    labels = input_ids.where(real, -100)
    head = CausalLMLoss(lm)

    def loss_and_grads(mask: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        lm.zero_grad()
        total = head(input_ids, labels, attention_mask=mask)
        total.backward()
        return total.detach(), [p.grad.clone() for p in lm.parameters()]

    seen: list[Any] = []
    hook = lm.model.layers[0].register_forward_pre_hook(lambda _, a, kw: seen.append(kw), with_kwargs=True)
    without, grads_without = loss_and_grads(None)
    hook.remove()
    with_mask, grads_with = loss_and_grads(real.long())
    assert seen[0].get("attention_mask") is None, "a right-padded batch got a materialised mask"
    torch.testing.assert_close(without, with_mask, rtol=1e-6, atol=0)
    for a, b in zip(grads_without, grads_with, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)  # other kernels; a leak would be ~1e-2
