"""Measured peak memory of training vs `llmexp.estimate`, for one composed config.

    python benchmarks/memory.py [overrides ...]          # e.g. model.hidden_size=512 optimizer=lion
    python benchmarks/memory.py --json [overrides ...]   # one JSON line (what tests/test_estimate.py reads)

It builds the model, loss head and optimizer exactly as the trainer does (`llmexp.model.build`), runs
three optimizer steps on random tokens of the configured shape, and reports the peak:
on CUDA `max_memory_allocated` (the same number a run's summary.json `peak_mem_mb` holds), on CPU
the peak RSS minus the RSS before the model was built (so that the Python/torch runtime, which a
run's `peak_mem_mb` includes, does not count against the estimate). No data set is loaded.
Run it in a fresh process per config: peak RSS only grows.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _warm_up(cfg: Any, device: Any, overrides: list[str]) -> None:
    """One step of a 1-layer, 64-wide model of the same kind with the same optimizer and precision."""
    import gc

    from llmexp.cli.estimate import compose

    small = compose([*overrides, "model.hidden_size=64", "model.num_hidden_layers=1", "model.intermediate_size=128",
                     "model.num_attention_heads=2", "model.num_key_value_heads=2", "model.vocab_size=512",
                     "batch_size=1", "data.max_length=16", "model.max_position_embeddings=16"])
    _train(small, device, steps=1)
    gc.collect()


def _train(cfg: Any, device: Any, steps: int) -> None:
    import torch

    from llmexp.model import build
    from llmexp.model.estimate import resolved_precision
    from llmexp.model.loss import CausalLMLoss

    model = CausalLMLoss(build.build_model(cfg, cfg.model.vocab_size)).to(device)
    optimizer = build.build_optimizer(cfg, model, 1e-4, device.type)
    dtype = build.autocast_dtype(resolved_precision(cfg.precision.name))
    shape = (cfg.batch_size, cfg.data.max_length)
    for _ in range(steps):
        ids = torch.randint(0, cfg.model.vocab_size, shape, device=device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=ids)
        (loss / ids.numel()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def measure(overrides: list[str], steps: int = 3) -> dict[str, Any]:
    """Train `steps` steps of the config's shape; the measured peak and the estimate, in MiB."""
    import torch

    from llmexp.cli.estimate import compose
    from llmexp.model.estimate import count_params_meta, estimate, resolved_precision, summary
    from llmexp.monitor.throughput import peak_rss_mb, reset_peak_rss, rss_mb

    cfg = compose(overrides)
    precision = resolved_precision(cfg.precision.name)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    _warm_up(cfg, device, overrides)  # load kernels and libraries before the baseline: they are runtime, not state
    base_mb = rss_mb() if device.type == "cpu" else 0.0
    reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _train(cfg, device, steps)
    on_cuda = device.type == "cuda"
    measured = torch.cuda.max_memory_allocated(device) / 2**20 if on_cuda else peak_rss_mb() - base_mb
    est = estimate(cfg, num_params=count_params_meta(cfg), precision=precision, world=1)
    figures = summary(est)
    return {"overrides": overrides, "device": device.type, "precision": precision, "num_params": est.num_params,
            "measured_mb": measured, "baseline_rss_mb": base_mb, **figures,
            "error": (figures["total_mb"] - measured) / measured}


def main() -> int:
    args = sys.argv[1:]
    as_json = "--json" in args
    result = measure([a for a in args if a != "--json"])
    if as_json:
        print(json.dumps(result))
        return 0
    print(f"{' '.join(result['overrides']) or '(defaults)'}  [{result['device']}, {result['precision']}, "
          f"{result['num_params'] / 1e6:.1f} M params]")
    for key in ("weights_mb", "gradients_mb", "optimizer_mb", "activations_mb", "total_mb"):
        print(f"  estimate {key[:-3]:<12} {result[key]:>10,.1f} MiB")
    print(f"  measured peak         {result['measured_mb']:>10,.1f} MiB  (error of the estimate: "
          f"{result['error']:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
