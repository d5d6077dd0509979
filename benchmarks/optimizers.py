"""Every optimizer option against AdamW: training tokens/s, optimizer step time, state bytes.

    python benchmarks/optimizers.py                    # 2 rounds, 5 warm-up + 20 timed steps per run
    python benchmarks/optimizers.py --rounds 3 --steps 40 --only adamw,adamw8bit

Each round trains the tiny model (micro-batch 8 x 256, bf16) once per optimizer with
`python -m llmexp`, in fresh processes and a rotated order; tokens/s are paired with AdamW's in
the same round. A second kind of fresh process builds each optimizer exactly as llmexp does
(`build.build_optimizer`) and times its step alone on random gradients, then counts its state
bytes. Every 8-bit option is bitsandbytes' own class, on CPU as on GPU. Writes
benchmarks/results/optimizers.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from llmexp.config.schema import compose_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    PY,
    Series,
    llmexp_tokens_per_sec,
    load_average,
    markdown_table,
    publish,
    rotated,
    run_process,
    utc_now,
)

OPTIMIZERS: dict[str, list[str]] = {
    "adamw": ["optimizer=adamw"],
    "adamw8bit": ["optimizer=adamw8bit"],
    "paged_adamw8bit": ["optimizer=paged_adamw8bit"],
    "lion": ["optimizer=lion"],
    "lion8bit": ["optimizer=lion8bit"],
    "sgd": ["optimizer=sgd"],
}
LR = {"lion": 1e-4, "lion8bit": 1e-4, "sgd": 0.1}


def worker_state(name: str, steps: int) -> dict[str, Any]:
    """Build the optimizer as llmexp does, time its step on random gradients, count its state bytes."""
    import torch

    from llmexp.model import build

    cfg = compose_config(OPTIMIZERS[name])
    torch.manual_seed(0)
    model = build.build_model(cfg, cfg.model.vocab_size)
    optimizer = build.build_optimizer(cfg, model, LR.get(name, 3e-4), "cpu")
    times = []
    for step in range(steps + 2):  # the first two are not timed (state allocation, compilation)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        start = time.perf_counter()
        optimizer.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items()
                if torch.is_tensor(t) and k not in ("qmap1", "qmap2"))  # bitsandbytes' shared 1 KB maps
    return {"step_ms": 1000 * statistics.median(times), "state_bytes": state, "class": type(optimizer).__module__
            + "." + type(optimizer).__name__}


def train_rate(name: str, warmup: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        overrides = [*OPTIMIZERS[name], f"lr={LR.get(name, 3e-4)}", "precision=bf16", "batch_size=8",
                     "data.max_length=256", f"train.max_steps={warmup + steps}", f"train.logging_steps={warmup}",
                     "train.eval_steps=1000000", "train.eval_batches=1", "train.save_steps=0", "train.peak_tflops=1"]
        res = run_process([PY, "-m", "llmexp", *overrides, f"hydra.run.dir={run_dir}"])
        if res.returncode != 0:
            print(f"{name}: llmexp failed (exit {res.returncode}):\n{res.tail}", file=sys.stderr)
            return 0.0
        return llmexp_tokens_per_sec(run_dir, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-reps", type=int, default=10, help="timed optimizer steps in the step-time worker")
    parser.add_argument("--only", default=",".join(OPTIMIZERS), help="comma-separated subset")
    parser.add_argument("--out", default="optimizers.md", help="file name under benchmarks/results/ ('' skips)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker_state(args.worker, args.step_reps)), flush=True)
        return
    names = [n for n in args.only.split(",") if n]
    if "adamw" not in names:
        names.insert(0, "adamw")
    rates = {n: Series() for n in names}
    ratios = {n: Series() for n in names}
    step_ms = {n: Series() for n in names}
    info: dict[str, dict[str, Any]] = {}
    for r in range(args.rounds):
        round_rates = {}
        for name in rotated(names, r):
            round_rates[name] = train_rate(name, args.warmup, args.steps)
            rates[name].values.append(round_rates[name])
            res = run_process([PY, __file__, "--worker", name, "--step-reps", str(args.step_reps)])
            if res.data:
                info[name] = res.data
                step_ms[name].values.append(res.data["step_ms"])
            ms = res.data.get("step_ms", 0.0)
            print(f"round {r + 1}: {name:16s} {round_rates[name]:8,.0f} tok/s  step {ms:7.1f} ms",
                  file=sys.stderr, flush=True)
        for name, rate in round_rates.items():
            if round_rates.get("adamw"):
                ratios[name].values.append(rate / round_rates["adamw"])
    adamw_state = info.get("adamw", {}).get("state_bytes", 0)
    rows = []
    for name in names:
        state = info.get(name, {}).get("state_bytes", 0)
        rows.append([f"`{name}`", info.get(name, {}).get("class", "?"), f"{rates[name].median():,.0f}",
                     f"{ratios[name].median():.3f}× ({ratios[name].spread('{:.3f}')})",
                     f"{step_ms[name].median():.1f}", f"{state / 2**20:.1f}",
                     f"{state / adamw_state:.3f}×" if adamw_state else "–"])
    table = markdown_table(["optimizer", "class (on CPU)", "tokens/s", "vs AdamW, paired", "step alone (ms)",
                            "state (MiB)", "state vs AdamW"], rows)
    text = (f"Measured {utc_now()}: tiny model (7.4M params), micro-batch 8 x 256, bf16; {args.rounds} rounds of "
            f"{args.warmup} warm-up + {args.steps} timed steps per optimizer; step time alone is the median of "
            f"{args.step_reps} steps on random gradients. Load average at the end: {load_average()}.\n\n{table}")
    publish(text, args.out)


if __name__ == "__main__":
    main()
