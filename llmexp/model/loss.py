"""The causal-LM loss as a *sum* over target tokens, computed without a full fp32 logits copy.

Why a sum: with gradient accumulation and several processes, the right loss is the mean over every target token of
the whole global batch; a mean of micro-batch means weights short sequences too much (transformers #34191). The
trainer divides each micro-batch's sum by the global batch's token count, known up front (deterministic sampler).

Why our own head: HF's forward materialises (B, L, V) logits, Accelerate casts them to fp32
(`convert_outputs_to_fp32`), and cross-entropy runs log-softmax forward and backward over that fp32 copy. We run the
decoder and fuse the projection with the loss in chunks (`LinearCrossEntropy`): per chunk one fp32 softmax gives both
the loss and d loss / d logits (softmax - one-hot), so the logits are never kept for backward nor copied to fp32 as a
whole; on CPU the loss part of the head takes about 4x less time. Positions without a target (prompt, padding) are
masked, not dropped: fixed shapes, so torch.compile sees one graph and no step waits on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmexp.data.datasets import IGNORE_INDEX
from llmexp.model.cpu_matmul import torch_mm_t

MatmulT = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""a, b -> a @ b.T: the fused head's three matmuls (`cpu_matmul.mm_t` where the run routes them to oneDNN)."""
CHUNK_TOKENS = 4096
"""Target positions projected at once: bounds the fp32 probabilities to CHUNK_TOKENS x vocab."""
LSE_SLICE_VALUES = 1 << 19
"""CPU: logits converted to fp32 at once for the logsumexp (2 MB: stays in cache)."""


class LinearCrossEntropy(torch.autograd.Function):
    """sum over rows of cross_entropy(hidden @ weight.T, targets), with the gradients made in forward (module
    docstring): backward only scales them by the incoming scalar (the trainer's 1 / target count). The matmuls
    run in `compute_dtype` (the autocast dtype), as autocast would run them; the loss is logsumexp - target logit
    in fp32, and the softmax is computed in fp32 and stored in `compute_dtype` (where autograd's path would
    round the same gradient to it anyway)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                compute_dtype: torch.dtype, grad_enabled: bool, mm_t: MatmulT = torch_mm_t) -> torch.Tensor:
        # needs_input_grad is True under torch.no_grad() too (it follows requires_grad): without the
        # caller's grad mode, every eval batch would compute the head's gradients for nothing.
        # A frozen head (LoRA leaves lm_head out) needs no weight gradient: that matmul is skipped.
        grad_h, grad_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            total = hidden.new_zeros((), dtype=torch.float32)
            grad_hidden = torch.empty_like(hidden) if grad_h else None
            grad_weight = None
            for start in range(0, hidden.shape[0], CHUNK_TOKENS):
                t = targets[start:start + CHUNK_TOKENS]
                keep = t != IGNORE_INDEX
                # where(), not a multiply: an ignored row's hidden state may be NaN/inf (a fully masked row), and
                # must add exactly 0 to the loss and gradients.
                h = hidden[start:start + CHUNK_TOKENS].where(keep[:, None], 0).to(compute_dtype)
                t = t.where(keep, 0)
                logits = mm_t(h, w)
                lse = _logsumexp_fp32(logits)
                target_logit = logits.gather(1, t[:, None]).squeeze(1).float()
                total = total + (lse - target_logit).where(keep, 0).sum()
                if grad_h or grad_w:
                    grad_logits = torch.softmax(logits, dim=1)  # computed in fp32, stored in compute_dtype
                    one_hot_term = (torch.exp(target_logit - lse) - 1.0).to(compute_dtype)  # p_target - 1
                    grad_logits.scatter_(1, t[:, None], one_hot_term[:, None])
                    if grad_hidden is not None:
                        grad_hidden[start:start + CHUNK_TOKENS] = mm_t(grad_logits, w.t()).where(keep[:, None], 0)
                    if grad_w:  # an ignored row's h is 0, so it adds nothing here; the first chunk writes the sum
                        chunk_grad = mm_t(grad_logits.t(), h.t()).float()
                        grad_weight = chunk_grad if grad_weight is None else grad_weight.add_(chunk_grad)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_total.float()
        # In place: these are our own buffers, used once (a second backward through this node would find them
        # modified and raise, as autograd checks saved tensors' versions); a fresh (V, d) copy costs a pass.
        return (grad_hidden.mul_(scale.to(grad_hidden.dtype)) if grad_hidden is not None else None,
                grad_weight.mul_(scale).to(ctx.weight_dtype) if grad_weight is not None else None,
                None, None, None, None)


def _logsumexp_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise logsumexp in fp32. On CPU in slices of ~2 MB, so that the fp32 copy stays in cache."""
    if logits.dtype == torch.float32 or logits.device.type != "cpu":
        return torch.logsumexp(logits.float(), dim=1)
    rows = max(1, LSE_SLICE_VALUES // logits.shape[1])
    return torch.cat([torch.logsumexp(logits[i:i + rows].float(), dim=1) for i in range(0, logits.shape[0], rows)])


class CausalLMLoss(nn.Module):
    """Wraps a HF causal LM so that DDP/DeepSpeed see one module whose forward returns the loss sum."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self.split = fused_head_problem(lm) is None
        """Decoder + fused head; False runs the model's own forward and its logits (always exact)."""
        self.head_mm_t: MatmulT = torch_mm_t
        """The fused head's fp32 CPU matmuls (`cpu_matmul.MatmulPath.matmul_t`; set where the run routes them)."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, per_row: bool = False) -> torch.Tensor:
        """The loss summed over every target token; `per_row`: a (batch,) tensor of each row's sum instead
        (task scoring: minus the log-likelihood of each row's continuation), without gradients."""
        # Every position keeps its row, the last one (and any prompt or padding) with target -100 (issue 41, item 4)
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).flatten()
        # use_cache=False: no KV cache in training, and with one transformers ignores packed position_ids
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  "use_cache": False}
        if not self.split:
            logits = self.lm(**inputs).logits.flatten(0, 1)
            return _token_loss_sum(lambda a, b: logits[a:b], targets, labels.shape, per_row)
        causal = causal_lm(self.lm)
        hidden = causal.model(**inputs).last_hidden_state.flatten(0, 1)
        if divisor := LOGIT_DIVISORS.get(causal.config.model_type):
            hidden = hidden / getattr(causal.config, divisor)
        head = causal.lm_head
        compute_dtype = None if per_row else _compute_dtype(hidden, head)
        if compute_dtype is not None:
            fp32_cpu = compute_dtype == torch.float32 and hidden.device.type == "cpu"
            return LinearCrossEntropy.apply(hidden, head.weight, targets, compute_dtype, torch.is_grad_enabled(),
                                            self.head_mm_t if fp32_cpu else torch_mm_t)
        # As in the fused head, an ignored row adds exactly 0 even if its hidden state is NaN/inf. Calling the
        # head module, not reading its weight: a ZeRO-3 hook gathers it first.
        hidden = hidden.where((targets != IGNORE_INDEX)[:, None], 0)
        return _token_loss_sum(lambda a, b: head(hidden[a:b]), targets, labels.shape, per_row)


def _token_loss_sum(logits_of: Callable[[int, int], torch.Tensor], targets: torch.Tensor, shape: torch.Size,
                    per_row: bool) -> torch.Tensor:
    """Each position's fp32 cross-entropy (0 where its target is -100), summed (`per_row`: per row of `shape`), from
    `logits_of(start, stop)` in chunks of CHUNK_TOKENS positions: the fp32 copy of the logits is one chunk's."""
    losses = torch.cat([F.cross_entropy(logits_of(a, a + CHUNK_TOKENS).float(), targets[a:a + CHUNK_TOKENS],
                                        ignore_index=IGNORE_INDEX, reduction="none")
                        for a in range(0, targets.shape[0], CHUNK_TOKENS)])
    return losses.view(shape).sum(1) if per_row else losses.sum()


FUSED_HEAD_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo", "olmo2", "smollm3", "granite")
"""Model types whose logits are exactly `lm_head(model(...).last_hidden_state)` (Granite's divided by
`logits_scaling`: `LOGIT_DIVISORS`): checked against each architecture's modelling code
(tests/test_architectures.py). Anything else, e.g. Gemma 2's soft-capped logits, Cohere's logit scale, or a type
added later, uses its own forward."""
LOGIT_DIVISORS = {"granite": "logits_scaling"}
"""Model types whose logits are the head's divided by a config field (muP's output multiplier, `model.mup`): the
fused head takes the hidden state divided by it, the same logits since the head is linear without a bias."""
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling",
                    "output_multiplier_scale")
"""Config fields that change logits after the head: set on any model, they rule the fused head out."""


def causal_lm(lm: nn.Module) -> nn.Module:
    """The transformers model itself: inside a peft model the adapters live in its layers, so its
    decoder and head run them; the wrapper only forwards."""
    get_base = getattr(lm, "get_base_model", None)
    return get_base() if callable(get_base) else lm


def fused_head_problem(lm: nn.Module) -> str | None:
    """Why the fused head would not be exact for `lm` (None: it is). The check is by what the model
    does to its logits, since a wrong loss would be silent: an unknown type is skipped, not guessed."""
    lm = causal_lm(lm)
    config = getattr(lm, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FUSED_HEAD_TYPES:
        return f"model type {model_type!r} is not known to produce lm_head(hidden) as its logits"
    if not (hasattr(lm, "model") and isinstance(getattr(lm, "lm_head", None), nn.Linear)):
        return "no decoder + linear lm_head split"
    for name in LOGIT_TRANSFORMS:
        if name != LOGIT_DIVISORS.get(model_type) and getattr(config, name, None) not in (None, 0, 1, 1.0):
            return f"the config's {name}={getattr(config, name)} transforms the logits (soft-capping or scaling)"
    if lm.lm_head.bias is not None:
        return "the lm_head has a bias"
    return None


def _compute_dtype(hidden: torch.Tensor, head: nn.Module) -> torch.dtype | None:
    """The matmul dtype of the fused head, or None where autograd's path is the right one: fp16 (the
    unscaled softmax gradient would underflow before the loss scale is applied), a head with a bias, or a
    weight that a ZeRO-3 hook must gather first (calling the module does that; reading `.weight` does not).
    torch.compile traces the fused head too (one graph, fixed shapes), and it keeps no logits for backward.
    """
    weight = getattr(head, "weight", None)
    if getattr(head, "bias", None) is not None or weight is None or hasattr(weight, "ds_id") or weight.dim() != 2:
        return None
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    return None if dtype == torch.float16 else dtype
