"""The loss head alone: the projection to the vocabulary and cross-entropy, forward and backward, three ways.

    python benchmarks/loss_head.py                                        # small shapes on this machine's CPU
    python benchmarks/loss_head.py --tokens 16384 --hidden 1024 --vocab 32000 --out loss_head_gpu.md   # a GPU

- `plain`: the whole batch's logits, then fp32 cross-entropy (what a model's own forward and loss do);
- `llmexp`: llmexp's fused head (`llmexp.model.loss.LinearCrossEntropy`: chunks of positions, one fp32 softmax
  a chunk gives the loss and its gradient, no logits kept for backward);
- `liger` (CUDA, where `liger-kernel` is installed): Liger's `LigerFusedLinearCrossEntropyLoss`, the one issue
  41 asks to use where it measures faster than ours.

Hidden states and the head's weight are fp32 (the plain engine's master weights), the matmuls in bf16 under
autocast, as in a `precision=bf16` run; a quarter of the targets are -100 (prompt or padding). Prints tokens/s
(paired with `plain` within each round), peak memory on CUDA and each arm's loss and gradient against `plain`'s.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from typing import Any

from common import in_process_cells, in_process_header, markdown_table, publish, time_in_process

from llmexp.model.loss import IGNORE_INDEX, LinearCrossEntropy


def loss_fns(device: Any) -> dict[str, Callable[[Any, Any, Any], Any]]:
    """Each available arm: (hidden, weight, targets) -> the summed loss."""
    import torch
    import torch.nn.functional as F

    def plain(h: Any, w: Any, t: Any) -> Any:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = h @ w.t()
        return F.cross_entropy(logits.float(), t, ignore_index=IGNORE_INDEX, reduction="sum")

    def fused(h: Any, w: Any, t: Any) -> Any:
        return LinearCrossEntropy.apply(h, w, t, torch.bfloat16, True)

    fns = {"plain": plain, "llmexp": fused}
    if device.type == "cuda":
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError:
            return fns
        liger_loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")

        def liger(h: Any, w: Any, t: Any) -> Any:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return liger_loss(w, h, t)

        fns["liger"] = liger
    return fns


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="positions a step (micro-batch x sequence)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="", help="file under benchmarks/results/ ('' prints only)")
    return p.parse_args()


def main() -> None:
    import torch

    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).to(device).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    targets[torch.rand(args.tokens, generator=gen) < 0.25] = IGNORE_INDEX
    targets = targets.to(device)
    fns = loss_fns(device)

    def step(fn: Callable[[Any, Any, Any], Any]) -> tuple[float, Any]:
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, targets)
        loss.backward()
        return float(loss.detach()), hidden.grad

    results = {name: step(fn) for name, fn in fns.items()}
    seconds, peak_mb = time_in_process({name: partial(step, fn) for name, fn in fns.items()}, args.rounds,
                                       args.warmup, args.steps)
    publish(render(args, seconds, peak_mb, results), args.out)


def render(args: argparse.Namespace, seconds: dict[str, list[float]], peak_mb: dict[str, float],
           results: dict[str, tuple[float, Any]]) -> str:
    ref_loss, ref_grad = results["plain"]
    rows = []
    for name in seconds:
        loss, grad = results[name]
        grad_err = float((grad - ref_grad).abs().max() / ref_grad.abs().max())
        rows.append([f"`{name}`", *in_process_cells(seconds, peak_mb, name, "plain", args.tokens),
                     f"{loss - ref_loss:+.2e}", f"{grad_err:.1e}"])
    missing = "" if "liger" in seconds else " `liger` runs on CUDA where `liger-kernel` is installed: not here."
    what = (f"{args.tokens:,} positions a step, hidden {args.hidden}, vocabulary {args.vocab:,}, fp32 hidden states "
            "and weight, bf16 matmuls; a quarter of the targets ignored; one forward and backward a step")
    return (f"# The loss head alone\n\n{in_process_header(what, args.rounds, args.warmup, args.steps)}{missing}\n\n"
            + markdown_table(["arm", "positions/s (median)", "speed vs `plain` (paired)", "peak memory (MiB)",
                              "loss − plain's", "hidden grad: largest error / largest value"], rows) + "\n")


if __name__ == "__main__":
    main()
