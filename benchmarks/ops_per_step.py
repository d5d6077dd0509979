"""How many ops a training step dispatches, full fine-tuning against LoRA: why a small model's LoRA is slower on a GPU.

    python benchmarks/ops_per_step.py              # the GPU check's 0.27B layout (16 layers), narrowed: ~1 minute
    python benchmarks/ops_per_step.py --layers 4   # any depth: the count grows with layers, not with width

The first GPU run measured LoRA at 0.46x full fine-tuning's tokens/s on a 0.27B Llama at 8 x 1024 tokens
(benchmarks/results/gpu.md, step 4), where the adapters skip two thirds of the base's matmul work. In eager mode
every aten op is at least one kernel launch and its Python and dispatch overhead on the host, while the device
waits when a step's work is short: a step is host-bound once ops x (host time an op) > the device's time. This
counts the ops (a `TorchDispatchMode` sees each one, on any device) in one step that logs nothing, through
llmexp's own `train()`, for each arm; the count does not depend on the model's width, so a narrow model with the
GPU model's depth gives the GPU model's count in seconds on a CPU. Compiled arms are not counted: inside a
compiled region a dispatch mode sees the graph's ops, not the few fused kernels the GPU runs.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import machine, markdown_table, publish, utc_now
from llmexp.config.schema import compose_config

ARMS = {"full": ["peft=none"], "lora": ["peft=lora"], "lora, dropout 0": ["peft=lora", "peft.lora_dropout=0"]}


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def ops_in_one_step(overrides: list[str], layers: int, run_dir: Path) -> collections.Counter[str]:
    """The ops of step 3 of a 4-step run (steps 1-2 warm up; step 4 logs and ends), counted between the logger's
    once-a-step `advance` calls."""
    from llmexp.monitor.logger import MetricsLogger
    from llmexp.train.train import train

    cfg = compose_config([*overrides, f"model.num_hidden_layers={layers}", "model.hidden_size=64",
                   "model.intermediate_size=128", "model.num_attention_heads=2", "model.num_key_value_heads=2",
                   "data.max_length=64", "data.max_examples=40", "batch_size=2", "precision=bf16", "train.max_steps=4",
                   "train.logging_steps=1000", "train.eval_steps=1000", "train.save_steps=0", "train.peak_tflops=1",
                   "train.save_final=false"], run_dir)
    counter, marks = OpCounter(), []
    advance = MetricsLogger.advance

    def marked(self: MetricsLogger, steps: int = 1) -> None:
        marks.append(collections.Counter(counter.counts))
        advance(self, steps)

    MetricsLogger.advance = marked  # type: ignore[method-assign]  # a benchmark's own process: nothing to restore
    try:
        with counter:
            train(cfg)
    finally:
        MetricsLogger.advance = advance  # type: ignore[method-assign]
    return marks[2] - marks[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (the GPU check's mid model: 16)")
    parser.add_argument("--out", default="ops_per_step.md", help="file name under benchmarks/results ('': none)")
    args = parser.parse_args()
    rows, counts = [], {}
    for arm, overrides in ARMS.items():
        with tempfile.TemporaryDirectory() as tmp:
            counts[arm] = ops_in_one_step(overrides, args.layers, Path(tmp))
        total = sum(counts[arm].values())
        top = ", ".join(f"{name} {n}" for name, n in counts[arm].most_common(4))
        rows.append([arm, f"{total:,}", f"{total / sum(counts['full'].values()):.2f}×", top])
    adapters = 7 * args.layers  # peft=lora's all-linear: q, k, v, o, gate, up, down in every layer
    extra = (sum(counts["lora"].values()) - sum(counts["full"].values())) / adapters
    text = (f"Measured {utc_now()} on {machine()}, torch {torch.__version__}: one training step of a "
            f"{args.layers}-layer Llama (precision=bf16, AdamW) through llmexp's `train()`, aten ops counted by a "
            "dispatch mode.\n\n"
            + markdown_table(["arm", "ops a step", "to full", "most frequent"], rows)
            + f"\n\nLoRA adds {extra:.1f} ops a step per adapter ({adapters} adapters: every linear layer).")
    publish(text, args.out)


if __name__ == "__main__":
    main()
