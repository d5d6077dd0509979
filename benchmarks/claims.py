"""The seed's claims, measured: one command regenerates the README table.

    python benchmarks/claims.py                  # ~5 minutes on 2 idle cores
    python benchmarks/claims.py --rounds 3 --steps 30 --healthy-steps 200

Prints the markdown table and writes it to benchmarks/results/claims.md. Covered:
bf16 speed and memory against fp32 (fresh llmexp processes, alternating, paired ratios);
8-bit AdamW's and Lion's optimizer-state bytes against AdamW's, and the saving projected for
Llama-2-7B; gradient accumulation against the bigger batch (llmexp end to end, and the seed's
`loss / accumulation_steps` recipe on padded SFT batches); the grad-norm range of a healthy run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.conftest's sft_file
from common import (
    PY,
    Series,
    llmexp_tokens_per_sec,
    load_average,
    load_records,
    markdown_table,
    publish,
    rotated,
    run_process,
    utc_now,
)

SMALL = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
         "model.num_key_value_heads=2", "model.intermediate_size=128", "model.vocab_size=512"]
LLAMA2_7B = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32}


def llmexp_run(overrides: list[str], run_dir: Path) -> tuple[dict[str, Any], float]:
    """One `python -m llmexp` run in a fresh process: (summary, peak RSS MB)."""
    res = run_process([PY, "-m", "llmexp", *overrides, f"hydra.run.dir={run_dir}"])
    summary_path = run_dir / "summary.json"
    if res.returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"llmexp {' '.join(overrides)} failed (exit {res.returncode}):\n{res.tail}")
    return json.loads(summary_path.read_text()), res.peak_rss_mb


# ---------------------------------------------------------------- bf16 against fp32


def precision_speed_memory(rounds: int, warmup: int, steps: int) -> dict[str, Any]:
    rates = {p: Series() for p in ("bf16", "fp32")}
    rss = {p: Series() for p in ("bf16", "fp32")}
    ratios = Series()
    for r in range(rounds):
        round_rates = {}
        for precision in rotated(["bf16", "fp32"], r):
            with tempfile.TemporaryDirectory() as tmp:
                overrides = [f"precision={precision}", "batch_size=8", "data.max_length=256",
                             f"train.max_steps={warmup + steps}", f"train.logging_steps={warmup}",
                             "train.eval_steps=1000000", "train.eval_batches=1", "train.save_steps=0",
                             "train.peak_tflops=1", "lr=3e-4"]
                _, peak = llmexp_run(overrides, Path(tmp) / "run")
                round_rates[precision] = llmexp_tokens_per_sec(Path(tmp) / "run", warmup)
            rates[precision].values.append(round_rates[precision])
            rss[precision].values.append(peak)
        ratios.values.append(round_rates["bf16"] / round_rates["fp32"])
    return {"rates": rates, "rss": rss, "ratio": ratios}


# ---------------------------------------------------------------- optimizer state


def state_bytes(optimizer: Any) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items()
               if hasattr(t, "numel") and k not in ("qmap1", "qmap2"))  # bitsandbytes' shared 1 KB maps


def optimizer_states() -> dict[str, float]:
    """State bytes after one step on the tiny model, relative to torch AdamW's."""
    import bitsandbytes as bnb
    import torch
    from common import llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config())
    makers = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
              "adamw8bit": lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3),
              "lion": lambda ps: bnb.optim.Lion(ps, lr=1e-4), "lion8bit": lambda ps: bnb.optim.Lion8bit(ps, lr=1e-4)}
    sizes = {}
    for name, make in makers.items():
        opt = make(list(model.parameters()))
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
        sizes[name] = state_bytes(opt)
        opt.zero_grad(set_to_none=True)
    return {name: size / sizes["adamw"] for name, size in sizes.items()}


def projected_7b_saving_gb() -> tuple[float, float, float]:
    """Llama-2-7B (every weight trained): AdamW state, 8-bit AdamW state (bitsandbytes' rules), in GB."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    BLOCK_SIZE = 256  # bitsandbytes' blockwise quantisation: one fp32 absmax per 256 values

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA2_7B))
    numels = [p.numel() for p in model.parameters()]
    adamw = sum(8 * n for n in numels)
    eight = sum(2 * n + 2 * 4 * -(-n // BLOCK_SIZE) if n >= 4096 else 8 * n for n in numels)
    return sum(numels) / 1e9, adamw / 1e9, eight / 1e9


# ---------------------------------------------------------------- accumulation


def accumulation_end_to_end(steps: int) -> dict[str, float]:
    """llmexp: batch 8 x 1 against batch 2 x accumulation 4, fp32, padded SFT rows."""
    from safetensors.torch import load_file

    from tests.conftest import sft_file  # the test suite's padded SFT data (needs pytest, as kill_resume.py)

    with tempfile.TemporaryDirectory() as tmp:
        data = sft_file(Path(tmp) / "sft.jsonl")
        common = [*SMALL, "data=json", f"data.train_file={data}", "data.packing=false", "data.max_length=64",
                  "precision=fp32", f"train.max_steps={steps}", "train.logging_steps=1", "train.eval_steps=1000",
                  "train.eval_batches=1", "train.save_steps=0", "lr=3e-3", "train.warmup_steps=2", "seed=1"]
        runs = {"big": ["batch_size=8", "train.gradient_accumulation_steps=1"],
                "small": ["batch_size=2", "train.gradient_accumulation_steps=4"]}
        losses, weights = {}, {}
        for name, extra in runs.items():
            run_dir = Path(tmp) / name
            llmexp_run([*common, *extra], run_dir)
            losses[name] = [r["loss"] for r in load_records(run_dir) if r.get("event") == "train"]
            weights[name] = load_file(str(run_dir / "model" / "model.safetensors"))
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses["small"], losses["big"], strict=True))
    weight_diff = max(float((weights["small"][k] - w).norm() / w.norm()) for k, w in weights["big"].items())
    return {"loss_rel": loss_diff, "weight_rel": weight_diff, "steps": len(losses["big"])}


def accumulation_gradients() -> dict[str, float]:
    """One global batch of 8 padded SFT rows, split 4 x 2: gradient error against the one big batch of
    the seed's recipe (mean per micro-batch / accumulation_steps) and of llmexp's (sum / global target count)."""
    import torch
    from common import llama_config
    from transformers import LlamaForCausalLM

    from llmexp.model.loss import CausalLMLoss

    torch.manual_seed(0)
    lm = LlamaForCausalLM(llama_config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=2, vocab_size=512))
    head = CausalLMLoss(lm)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (8, 64), generator=gen)
    labels = ids.clone()
    for row in range(8):  # prompts of different lengths masked out, as in SFT
        labels[row, : int(torch.randint(4, 60, (1,), generator=gen))] = -100
    n_targets = int((labels[:, 1:] != -100).sum())

    def grads(micro_losses: list[Any]) -> Any:
        lm.zero_grad(set_to_none=True)
        sum(micro_losses).backward()
        return torch.cat([p.grad.flatten() for p in lm.parameters()])

    big = grads([head(ids, labels) / n_targets])
    micro = [(ids[i:i + 2], labels[i:i + 2]) for i in range(0, 8, 2)]
    ours = grads([head(x, y) / n_targets for x, y in micro])
    seed = grads([head(x, y) / int((y[:, 1:] != -100).sum()) / len(micro) for x, y in micro])
    return {"llmexp": float((ours - big).norm() / big.norm()), "seed": float((seed - big).norm() / big.norm())}


# ---------------------------------------------------------------- healthy grad norm


def grad_norm_range(steps: int) -> dict[str, float]:
    """The default run (tiny model, stdlib, lr=auto, cosine) for `steps` steps; grad norms after warmup."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        summary, _ = llmexp_run([f"train.max_steps={steps}", "train.logging_steps=1", "train.eval_batches=2",
                                 "train.save_steps=0"], run_dir)
        records = [r for r in load_records(run_dir) if r.get("event") == "train"]
    warmup = max(1, int(0.05 * steps))
    norms = sorted(float(r["grad_norm"]) for r in records if r["step"] > warmup)
    q = statistics.quantiles(norms, n=20)
    inside = sum(0.5 <= n <= 2.0 for n in norms) / len(norms)
    return {"p5": q[0], "p50": statistics.median(norms), "p95": q[-1], "min": norms[0], "max": norms[-1],
            "inside": inside, "steps": steps, "warmup": warmup, "status": summary["status"],
            "eval_loss": summary["eval_loss"]}


# ---------------------------------------------------------------- the table


def render(prec: dict[str, Any], states: dict[str, float], seven_b: tuple[float, float, float],
           acc: dict[str, float], acc_grads: dict[str, float], gn: dict[str, float]) -> str:
    rss_b, rss_f = prec["rss"]["bf16"].median(), prec["rss"]["fp32"].median()
    n7, adamw7, eight7 = seven_b
    gpu = "not measured: no GPU was lent to this task"
    rows = [
        ["bf16 autocast speed vs fp32", "1.5–2× faster",
         f"{prec['ratio'].median():.2f}× ({prec['ratio'].spread('{:.2f}')}) tokens/s, paired; "
         f"{prec['rates']['bf16'].median():,.0f} vs {prec['rates']['fp32'].median():,.0f} tokens/s", gpu],
        ["bf16 autocast memory vs fp32", "40–50% less",
         f"peak RSS {rss_b:,.0f} vs {rss_f:,.0f} MB ({(rss_b - rss_f) / rss_f:+.0%}); fp32 master weights and "
         "the process's libraries dominate at this size", gpu],
        ["8-bit AdamW state vs AdamW", "1/4",
         f"{states['adamw8bit']:.3f}× (bitsandbytes): uint8 moments + one fp32 absmax per 256 values", gpu],
        ["8-bit AdamW saving, 7B", "5–8 GB",
         f"{adamw7 - eight7:.1f} GB projected for Llama-2-7B with every weight trained ({n7:.2f}B params: "
         f"{adamw7:.1f} → {eight7:.1f} GB of state); the seed's 5–8 GB fits ~1B trained params, e.g. adapters", gpu],
        ["Lion state vs AdamW", "half", f"{states['lion']:.3f}× (lion8bit {states['lion8bit']:.3f}×)", gpu],
        ["accumulation = a bigger batch", "2 × 16 ≡ 32",
         f"llmexp, batch 8 vs 2 × 4 on padded SFT rows (fp32, {acc['steps']} steps): losses within "
         f"{acc['loss_rel']:.1e}, weights within {acc['weight_rel']:.1e} (relative). The seed's "
         f"`loss / accumulation_steps` on the same kind of batch: gradient off by {acc_grads['seed']:.1%} "
         f"(llmexp's token-normalised sum: {acc_grads['llmexp']:.1e})", gpu],
        ["grad norm in a healthy run", "0.5–2.0",
         f"default run ({gn['steps']} steps, {gn['status']}, eval loss {gn['eval_loss']:.2f}): p5–p95 "
         f"{gn['p5']:.2f}–{gn['p95']:.2f}, median {gn['p50']:.2f}, min–max {gn['min']:.2f}–{gn['max']:.2f} "
         f"after warmup; {gn['inside']:.0%} of steps inside 0.5–2.0", gpu],
    ]
    head = (f"Measured {utc_now()} on CPU (2 cores, AVX512-BF16), tiny model (7.4M params) unless noted; "
            f"load average at the end: {load_average()}.")
    return head + "\n\n" + markdown_table(["claim", "the seed's figure", "llmexp measured (CPU)", "GPU"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="bf16/fp32 rounds (fresh processes, alternating)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per bf16/fp32 run")
    parser.add_argument("--accum-steps", type=int, default=8)
    parser.add_argument("--healthy-steps", type=int, default=100)
    parser.add_argument("--out", default="claims.md", help="file name under benchmarks/results/ ('' skips)")
    args = parser.parse_args()
    prec = precision_speed_memory(args.rounds, args.warmup, args.steps)
    print("bf16/fp32 done", file=sys.stderr, flush=True)
    states, seven_b = optimizer_states(), projected_7b_saving_gb()
    acc, acc_grads = accumulation_end_to_end(args.accum_steps), accumulation_gradients()
    print("states, accumulation done", file=sys.stderr, flush=True)
    text = render(prec, states, seven_b, acc, acc_grads, grad_norm_range(args.healthy_steps))
    publish(text, args.out)


if __name__ == "__main__":
    main()
