"""The causal-LM loss as a *sum* over target tokens, computed without a full fp32 logits copy.

Why a sum: with gradient accumulation and several processes, the right loss is the mean over
every target token of the whole global batch. A mean of micro-batch means weights short
sequences too much (transformers #34191). The trainer divides each micro-batch's sum by the
global batch's token count, known up front from the deterministic sampler.

Why our own head: HF's forward materialises (B, L, V) logits and Accelerate then casts them to
fp32 (`convert_outputs_to_fp32`). We run the decoder, project only the target positions, in
chunks, and let cross-entropy upcast one chunk at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
CHUNK_TOKENS = 4096
"""Target positions projected at once: bounds the fp32 logits to CHUNK_TOKENS x vocab."""


class CausalLMLoss(nn.Module):
    """Wraps a HF causal LM so that DDP/DeepSpeed see one module whose forward returns the loss sum."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        # Decoder + head split is known for Llama-family models; anything else uses its own logits.
        self.split = hasattr(lm, "model") and hasattr(lm, "lm_head") and lm.config.model_type in (
            "llama", "mistral", "qwen2", "qwen3", "phi3", "olmo", "olmo2", "smollm3")

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        targets = labels[:, 1:]
        keep = targets != IGNORE_INDEX
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        if not self.split:
            logits = self.lm(**inputs).logits[:, :-1]
            return F.cross_entropy(logits[keep].float(), targets[keep], reduction="sum")
        hidden = self.lm.model(**inputs).last_hidden_state
        hidden, flat_targets = hidden[:, :-1][keep], targets[keep]
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], CHUNK_TOKENS):
            logits = self.lm.lm_head(hidden[start:start + CHUNK_TOKENS])
            total = total + F.cross_entropy(logits.float(), flat_targets[start:start + CHUNK_TOKENS], reduction="sum")
        return total
