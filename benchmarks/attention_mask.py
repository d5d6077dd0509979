"""What an attention mask costs a training step: the same batch with no mask, a padding mask, and packed rows.

    python benchmarks/attention_mask.py                          # tiny model on this machine's CPU
    python benchmarks/attention_mask.py --size mid --seq-len 2048 --out attention_mask_gpu.md   # on a GPU

llmexp passes no mask for padded rows (one example a row, padded on the right: causal attention already hides
the padding, and its targets are -100), so SDPA can take its flash-class kernels; a padding mask makes transformers
build a dense (B, 1, L, L) one. Packed SFT rows (position ids restarting at each example) still get a dense
block-diagonal mask (docs/explanation/gpu-path.md). Three arms on the same tokens, one forward and backward a step:

- `causal`: no mask (llmexp's padded and pretraining rows), the baseline;
- `padding_mask`: an attention mask with zeros after each row's length (what a padded batch costs elsewhere);
- `packed`: position ids restarting at each example's start (llmexp's `sft_packed` rows), a dense
  block-diagonal mask under SDPA;
- `packed_flex` (CUDA only): the same rows under FlexAttention (`attn_implementation="flex_attention"`), whose
  block mask skips the blocks across examples: the candidate for issue 41's flash-class packed SFT.

Prints tokens/s (every position of the batch counted), the ratio to `causal` paired within each round, peak
memory on CUDA, and the loss of `causal` against `padding_mask` on the same batch (the targets after a row's
length are -100, so the two must agree: tests/test_loss.py checks it exactly on a CPU), and whether the packing
isolated each example (else the `packed` arm measured nothing: a KV cache, say, makes transformers ignore it).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from adapters import SIZES as ADAPTER_SIZES
from common import in_process_cells, in_process_header, llama_config, markdown_table, publish, time_in_process

SIZES: dict[str, dict[str, int]] = {"tiny": {}, "mid": ADAPTER_SIZES["mid"].model}
"""The tiny model as configured; the GPU check's 0.27B model (benchmarks/adapters.py's), the tiny one's vocabulary."""
ARM_MODEL = {"causal": "sdpa", "padding_mask": "sdpa", "packed": "sdpa", "packed_flex": "flex_attention"}
"""Each arm's attention implementation (transformers' `attn_implementation`)."""


def make_batch(batch: int, seq_len: int, vocab: int, device: Any) -> dict[str, Any]:
    """Tokens, each row's length (50-100% of the row, so a quarter of positions are padding on average), the
    padding mask, targets (-100 after the length) and packed position ids (examples of 64-512 tokens, at most half
    a row)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch,), generator=gen)
    keep = torch.arange(seq_len)[None, :] < lengths[:, None]
    labels = ids.masked_fill(~keep, -100)
    positions = torch.empty(batch, seq_len, dtype=torch.long)
    for row in range(batch):
        start = 0
        while start < seq_len:
            # at most half a row, so that every row packs two examples at least (packing_leak reads row 0's second)
            size = int(torch.randint(min(64, seq_len // 4), min(512, seq_len // 2) + 1, (1,), generator=gen))
            end = min(seq_len, start + size)
            positions[row, start:end] = torch.arange(end - start)
            start = end
    tensors = {"input_ids": ids, "labels": labels, "mask": keep.long(), "position_ids": positions}
    return {name: t.to(device) for name, t in tensors.items()}


def arm_inputs(arm: str, b: dict[str, Any]) -> dict[str, Any]:
    """The model's inputs for one arm. use_cache=False as in llmexp's loss: with a KV cache transformers ignores
    packed position ids (its masking_utils checks for packing only without one), and `packed` would run causal."""
    common = {"input_ids": b["input_ids"], "use_cache": False}
    if arm == "causal":
        return {**common, "labels": b["labels"]}
    if arm == "padding_mask":
        return {**common, "labels": b["labels"], "attention_mask": b["mask"]}
    return {**common, "labels": b["input_ids"], "position_ids": b["position_ids"]}  # packed, packed_flex


def packing_leak(model: Any, batch: dict[str, Any], dtype: Any, device: Any) -> float:
    """The largest logit difference between row 0's second example in its packed row and the same example alone:
    ~0 (rounding) where the packing reached attention, order 1 where the example saw the one before it."""
    import torch

    ids, positions = batch["input_ids"][:1], batch["position_ids"][:1]
    starts = [*(positions[0] == 0).nonzero().flatten().tolist(), positions.shape[1]]
    first, end = starts[1], starts[2]
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, first:end]
        alone = model(input_ids=ids[:, first:end], use_cache=False).logits[0]
    return float((packed.float() - alone.float()).abs().max())


def step_fn(model: Any, inputs: dict[str, Any], dtype: Any, device: Any) -> Callable[[], float]:
    import torch

    def step() -> float:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(**inputs).loss
        loss.backward()
        return float(loss.detach())  # the one read of the step: it waits for the device

    return step


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--out", default="", help="file under benchmarks/results/ ('' prints only)")
    return p.parse_args()


def build_models(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """One model per attention implementation, the same weights: SDPA always; FlexAttention on CUDA only (it has
    no backward on a CPU, torch 2.13)."""
    import torch
    from transformers import LlamaForCausalLM

    fields = {**SIZES[args.size], "max_position_embeddings": max(args.seq_len, SIZES[args.size].get(
        "max_position_embeddings", 0))}
    models = {}
    for implementation in ("sdpa", "flex_attention") if device.type == "cuda" else ("sdpa",):
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(**fields))
        model.set_attn_implementation(implementation)
        models[implementation] = model.to(device)
    return models


def main() -> None:
    import torch

    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    models = build_models(args, device)
    batch = make_batch(args.batch, args.seq_len, models["sdpa"].config.vocab_size, device)
    arms = [arm for arm, implementation in ARM_MODEL.items() if implementation in models]
    steps = {arm: step_fn(models[ARM_MODEL[arm]], arm_inputs(arm, batch), dtype, device) for arm in arms}
    losses = {arm: steps[arm]() for arm in arms}  # the first call of each: FlexAttention compiles here
    leaks = {arm: packing_leak(models[ARM_MODEL[arm]], batch, dtype, device) for arm in arms if "packed" in arm}
    seconds, peak_mb = time_in_process(steps, args.rounds, args.warmup, args.steps)
    params = sum(p.numel() for p in models["sdpa"].parameters())
    publish(render(args, precision, params, seconds, peak_mb, losses, leaks), args.out)


def isolation(leak: float) -> str:
    verdict = "isolated each example" if leak < 0.1 else "DID NOT isolate the examples (the arm measured nothing)"
    return f"{verdict} (row 0's second example: largest logit difference {leak:.2e} packed against alone)"


def render(args: argparse.Namespace, precision: str, params: int, seconds: dict[str, list[float]],
           peak_mb: dict[str, float], losses: dict[str, float], leaks: dict[str, float]) -> str:
    tokens = args.batch * args.seq_len
    rows = [[f"`{arm}`", ARM_MODEL[arm], *in_process_cells(seconds, peak_mb, arm, "causal", tokens)] for arm in seconds]
    packing = "; ".join(f"`{arm}` {losses[arm]:.6f}, {isolation(leak)}" for arm, leak in leaks.items())
    skipped = "" if "packed_flex" in seconds else " `packed_flex` runs on CUDA only (no FlexAttention backward on CPU)."
    what = (f"a random-init Llama of {params:,} parameters, micro-batch {args.batch} × {args.seq_len}, {precision}"
            f"{' autocast' if precision == 'bf16' else ''}, one forward and backward a step")
    return (f"# What an attention mask costs a step\n\n{in_process_header(what, args.rounds, args.warmup, args.steps)}"
            f"{skipped}\n\n"
            + markdown_table(["arm", "attention", "tokens/s (median)", "speed vs `causal` (paired)",
                              "peak memory (MiB)"], rows)
            + f"\n\nThe same batch's loss, `causal` {losses['causal']:.6f} against `padding_mask` "
            f"{losses['padding_mask']:.6f} (difference {abs(losses['causal'] - losses['padding_mask']):.2e}). "
            f"Packed: {packing}.\n")


if __name__ == "__main__":
    main()
