"""Measured per-rank memory of FSDP2 training vs `llmexp.estimate fsdp=...`, on CPU with gloo.

    MALLOC_MMAP_THRESHOLD_=131072 python -m torch.distributed.run --nproc_per_node 2 \\
        benchmarks/memory_fsdp.py [--json] [overrides ...]

For full_shard and shard_grad_op in turn, each rank builds the model and loss head as the trainer does
(`llmexp.model.build`), wraps each decoder layer and then the root in torch's `fully_shard` (shard_grad_op:
`reshard_after_forward=False`), and runs three optimizer steps on random tokens of the configured shape.
It reports, per strategy, the largest over ranks of
  state_mb     the bytes of the local shards of parameters, gradients and optimizer state (exact), and
  measured_mb  the peak RSS growth over the steps (baseline: the RSS before the model was built),
next to the estimate. Set MALLOC_MMAP_THRESHOLD_ as above: glibc otherwise keeps freed blocks of FSDP's
all-gather and reduce-scatter buffers on its heap, and the peak RSS creeps up with every step (we saw ~2x
the live bytes after three steps); with the threshold, large blocks are unmapped when freed and the RSS
follows the live bytes. The trainer's own FSDP path is `fsdp=...`; this wraps the model directly so that
the accounting is checked on its own.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

STRATEGIES = ("full_shard", "shard_grad_op")
SMALL = ["model.hidden_size=64", "model.num_hidden_layers=1", "model.intermediate_size=128",
         "model.num_attention_heads=2", "model.num_key_value_heads=2", "model.vocab_size=512",
         "batch_size=1", "data.max_length=16", "model.max_position_embeddings=16"]
"""The warm-up's model: loads kernels and gloo's buffers before the baseline (runtime, not state)."""


def _sharded(cfg: Any, strategy: str) -> tuple[Any, Any]:
    from torch.distributed.fsdp import fully_shard

    from llmexp.model import build
    from llmexp.model.loss import CausalLMLoss

    model = CausalLMLoss(build.build_model(cfg, cfg.model.vocab_size))
    keep_whole = strategy == "shard_grad_op"  # parameters stay gathered from forward to backward
    for layer in model.lm.model.layers:
        fully_shard(layer, reshard_after_forward=not keep_whole)
    fully_shard(model, reshard_after_forward=not keep_whole)  # the root: embeddings, head, final norm
    return model, build.build_optimizer(cfg, model, 1e-4, "cpu")


def _steps(cfg: Any, model: Any, optimizer: Any, steps: int, keep_grads: bool = False) -> None:
    import torch

    for step in range(steps):
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.batch_size, cfg.data.max_length))
        (model(input_ids=ids, labels=ids) / ids.numel()).backward()
        optimizer.step()
        if not (keep_grads and step == steps - 1):
            optimizer.zero_grad(set_to_none=True)


def _local_bytes(tensors: Any) -> int:
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def measure(overrides: list[str], strategy: str, world: int, steps: int = 3) -> dict[str, Any]:
    """One strategy on this rank: state bytes, peak RSS growth and the estimate, in MiB."""
    import torch

    from llmexp.cli.estimate import compose
    from llmexp.model.estimate import count_params_meta, estimate, summary
    from llmexp.monitor.throughput import peak_rss_mb, reset_peak_rss, rss_mb

    cfg = compose([*overrides, "precision=fp32", f"fsdp.name={strategy}"])
    torch.manual_seed(0)
    gc.collect()
    base_mb = rss_mb()
    reset_peak_rss()
    model, optimizer = _sharded(cfg, strategy)
    _steps(cfg, model, optimizer, steps, keep_grads=True)
    measured = peak_rss_mb() - base_mb
    params = list(model.parameters())
    state = (_local_bytes(params) + _local_bytes(p.grad for p in params if p.grad is not None)
             + _local_bytes(v for s in optimizer.state.values() for v in s.values()
                            if torch.is_tensor(v) and v.dim() > 0))
    est = estimate(cfg, num_params=count_params_meta(cfg), precision="fp32", world=world)
    figures = summary(est)
    del model, optimizer
    gc.collect()
    return {"strategy": strategy, "overrides": overrides, "world_size": world, "measured_mb": measured,
            "state_mb": state / 2**20, "state_estimate_mb": (est.weights + est.gradients + est.optimizer) / 2**20,
            "gathered_mb": est.gathered / 2**20, **figures, "error": (figures["total_mb"] - measured) / measured}


def _warm_up(overrides: list[str]) -> None:
    """One step of a 1-layer model under FSDP: kernels, FSDP's code paths and gloo's buffers load now."""
    from llmexp.cli.estimate import compose

    small = compose([*overrides, *SMALL, "precision=fp32"])
    model, optimizer = _sharded(small, "full_shard")
    _steps(small, model, optimizer, 1)
    del model, optimizer
    gc.collect()


def main() -> int:
    import torch.distributed as dist

    args = sys.argv[1:]
    overrides = [a for a in args if a != "--json"]
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    _warm_up(overrides)
    results = []
    for strategy in STRATEGIES:
        mine = measure(overrides, strategy, world)
        every = [None] * world
        dist.all_gather_object(every, mine)
        worst = max(every, key=lambda r: r["measured_mb"])  # the rank that needs the most decides what fits
        results.append(worst)
    dist.destroy_process_group()
    if rank:
        return 0
    for r in results:
        if "--json" in args:
            print(json.dumps(r))
            continue
        print(f"fsdp={r['strategy']} world_size={world} {' '.join(overrides)}")
        print(f"  local shards (params, grads, optimizer) {r['state_mb']:8.1f} MiB, estimate "
              f"{r['state_estimate_mb']:8.1f} MiB")
        print(f"  peak RSS growth {r['measured_mb']:8.1f} MiB, estimate {r['total_mb']:8.1f} MiB "
              f"(of which gathered {r['gathered_mb']:.1f}, activations {r['activations_mb']:.1f}); "
              f"error {r['error']:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
