"""Full fine-tuning against `peft=lora` and `peft=qlora` on the same model: trainable parameters,
frozen-weight bytes, optimizer-state bytes, peak memory and tokens/s.

    python benchmarks/adapters.py                  # ~32M-parameter Llama on this CPU: a few minutes
    python benchmarks/adapters.py --quick          # a 2.2M-parameter Llama, 3 steps: ~1 minute (tests run it)
    python benchmarks/adapters.py --size 1b    # ~1B parameters, on a GPU (the GPU check's step 4 runs --size mid)

A Llama-architecture model is built from its config class (random weights: speed and memory do not
depend on the values) and written with save_pretrained, with a byte-level BPE tokenizer of the same
vocabulary, into a temporary directory. Each arm is then `python -m llmexp model.name_or_path=DIR
peft=ARM ...` in a fresh process (so peak memory is that run's alone) on the stdlib data every machine
has, tokenised beforehand so no arm pays for it. Read from each run:

- trainable parameters: summary.json's `num_params` (adapters only under peft);
- optimizer state: the sum of the tensors' bytes in the final checkpoint's optimizer.pt (measured, not
  computed: AdamW keeps two fp32 moments, 8 bytes a trained parameter, plus a step counter per tensor);
- frozen weights: the bytes of the non-trainable parameters of the model as llmexp builds it
  (`build.build_model`, in another fresh process): bf16 under lora, packed 4-bit NF4 for the linear
  layers under qlora (embeddings, norms and the head stay fp32; the quantisation constants not counted);
- peak memory: summary.json's `peak_mem_mb` (peak RSS of the process on a CPU, loading included;
  torch.cuda.max_memory_allocated on a GPU);
- tokens/s: the train records after the warm-up steps (common.llmexp_tokens_per_sec).

Ratios are to full fine-tuning measured in the same invocation (in the same round with --rounds > 1).
An arm that fails is reported and left out of the table; the others still run (exit 1 at the end).
`--keep-base DIR` writes the base model there and keeps it, so that the runs can be repeated or
estimated (`python -m llmexp.estimate` with the `overrides` that `--json` prints for each arm).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmexp.config.schema import compose_config
from llmexp.rundir.read import load_records

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    PY,
    RESULTS,
    Series,
    llama_config,
    llmexp_tokens_per_sec,
    load_average,
    machine,
    markdown_table,
    publish,
    rotated,
    run_process,
    utc_now,
)

ARMS = ("full", "lora", "qlora")  # the default arms; `lora_compiled` on request (a GPU: see EXTRA)
PEFT = {"full": "none", "lora": "lora", "qlora": "qlora", "lora_compiled": "lora"}
EXTRA = {"lora_compiled": ["train.compile=true"]}
"""An arm's overrides besides `peft`: on a GPU a small model's eager LoRA step is host-bound (it dispatches twice the
ops of full fine-tuning, benchmarks/ops_per_step.py); the per-block compile fuses the adapters' small ops."""


@dataclass(frozen=True)
class Size:
    """A model and the run shape that goes with it."""

    model: dict[str, int]  # LlamaConfig fields over the tiny model's (benchmarks/common.llama_config)
    batch_size: int
    seq_len: int
    max_examples: int | None  # stdlib files to tokenise: enough for the steps, no more


SIZES: dict[str, Size] = {
    # ~2.2M parameters, test_peft's vocabulary: seconds per arm, yet r=16 is small against its width
    "tiny": Size({"vocab_size": 384, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}, 4, 32, 40),
    # ~32M parameters: the three arms take a few minutes on a 2-core CPU shared with other jobs (a 63M
    # model ran at ~25 tokens/s there, 40 s a step)
    "cpu": Size({"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8,
                 "num_key_value_heads": 4}, 4, 128, 100),
    # ~0.27B parameters, the GPU check's mid model (its step 4: the three arms fit its time there)
    "mid": Size({"hidden_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
                 "intermediate_size": 4096, "max_position_embeddings": 2048}, 8, 1024, None),
    # ~1.0B parameters, benchmarks/throughput.py's `--model 1b` (a GPU)
    "1b": Size({"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                "intermediate_size": 8192, "max_position_embeddings": 2048}, 8, 1024, None),
}


def tokenizer_for(vocab_size: int) -> Any:
    """A byte-level BPE with exactly `vocab_size` entries, so that the model's embedding matches it.

    The default vocabulary (8192) is llmexp's own stdlib tokenizer (cached after the first default run);
    a smaller one is trained on a few generated lines, as tests/test_peft.py does.
    """
    from llmexp.data.tokenizer import train_bpe, trained_tokenizer

    if vocab_size == 8192:
        return trained_tokenizer(compose_config([]))
    return train_bpe([f"def f{i}(x):\n    return x * {i}\n" for i in range(200)], vocab_size)


def write_base(directory: Path, size: Size) -> int:
    """Save a random Llama of `size` and its tokenizer in `directory`; return its parameter count."""
    import torch
    from transformers import LlamaForCausalLM

    config = llama_config(**size.model)
    tokenizer = tokenizer_for(config.vocab_size)
    assert len(tokenizer) == config.vocab_size, (len(tokenizer), config.vocab_size)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def data_overrides(size: Size) -> list[str]:
    limit = "null" if size.max_examples is None else str(size.max_examples)
    return ["data=stdlib", f"data.max_length={size.seq_len}", f"data.max_examples={limit}"]


def prepare_data(base: Path, size: Size) -> None:
    """Tokenise the data into llmexp's cache now, so the first arm's time and memory do not include it."""
    from llmexp.data.datasets import build_datasets
    from llmexp.data.tokenizer import load_tokenizer

    cfg = compose_config([f"model.name_or_path={base}", *data_overrides(size)])
    build_datasets(cfg, load_tokenizer(cfg))


def arm_overrides(arm: str, base: Path, size: Size, steps: int, precision: str, save: bool = True) -> list[str]:
    # one checkpoint, at the end: its optimizer.pt is measured; without it (--no-save) no file is written at all
    saves = [f"train.save_steps={steps}"] if save else ["train.save_steps=0", "train.save_final=false"]
    return [f"model.name_or_path={base}", f"peft={PEFT[arm]}", *EXTRA.get(arm, []), f"precision={precision}",
            *data_overrides(size),
            f"batch_size={size.batch_size}", f"train.max_steps={steps}", "train.logging_steps=1", *saves,
            "train.eval_steps=1000000", "train.eval_batches=1",
            "train.peak_tflops=1000000"]  # skips measuring the matmul ceiling; this table shows no MFU


def optimizer_state_bytes(checkpoint: Path) -> int:
    """Bytes of every tensor in the optimizer's saved state (moments and step counters)."""
    import torch

    from llmexp.checkpoint.serialize import load_state

    state = load_state(checkpoint / "optimizer.pt")["state"]
    return sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t))


def run_arm(arm: str, base: Path, size: Size, warmup: int, steps: int, precision: str,
            env: dict[str, str], save: bool = True) -> dict[str, Any]:
    """One llmexp run of `arm` in a fresh process; its figures, or {} (and the log's tail) on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        overrides = arm_overrides(arm, base, size, warmup + steps, precision, save)
        res = run_process([PY, "-m", "llmexp", *overrides, f"hydra.run.dir={run_dir}"], env=env)
        if res.returncode != 0:
            print(f"{arm}: llmexp failed (exit {res.returncode}):\n{res.tail}", file=sys.stderr)
            return {}
        summary = json.loads((run_dir / "summary.json").read_text())
        start = next(r for r in load_records(run_dir) if r.get("event") == "start")
        return {"bf16_emulated": bool(start.get("bf16_emulated")),
                "trainable": summary["num_params"], "total": summary["total_params"],
                "peak_mem_mb": summary["peak_mem_mb"], "tokens_per_sec": llmexp_tokens_per_sec(run_dir, warmup),
                "optimizer_bytes": optimizer_state_bytes(run_dir / "checkpoints" / f"step_{warmup + steps}")
                if save else None}


def frozen_bytes(base: Path, arm: str, precision: str) -> int:
    """Bytes of the frozen parameters of the model llmexp builds for `arm` (4-bit ones as packed)."""
    from llmexp.model import build

    cfg = compose_config([f"model.name_or_path={base}", f"peft={PEFT[arm]}"])
    model = build.build_model(cfg, 0, precision)  # the vocabulary comes from the saved config
    frozen = {id(p): p for p in model.parameters() if not p.requires_grad}.values()
    return sum(p.numel() * p.element_size() for p in frozen)




def worker_prepare(base: Path, size: Size, arms: list[str], precision: str) -> dict[str, Any]:
    """Everything but the runs, in a process of its own: the runs are its siblings, not its children,
    because a child's peak RSS (ru_maxrss) starts from its parent's at fork, exec or not."""
    total = write_base(base, size)
    prepare_data(base, size)
    return {"total": total, "device": machine(),
            "frozen_bytes": {arm: frozen_bytes(base, arm, precision) for arm in arms}}


def versions() -> str:
    from importlib.metadata import version

    return ", ".join(f"{name} {version(name)}" for name in ("torch", "transformers", "peft", "bitsandbytes"))


def ratio(value: float, full: float | None, fmt: str = "{:.3f}") -> str:
    return f" ({fmt.format(value / full)}×)" if full else ""


def render(results: dict[str, dict[str, Any]], rates: dict[str, Series], paired: dict[str, Series]) -> str:
    """The markdown table; every ratio is to the full arm (tokens/s: paired within each round)."""
    full = results.get("full", {})
    rows = []
    for arm, r in results.items():
        rate = rates[arm].median()
        paired_ratio = f" ({paired[arm].median():.2f}×)" if paired[arm].values and arm != "full" else ""
        rows.append([f"`peft={PEFT[arm]}`" + (" (full fine-tuning)" if arm == "full" else "")
                     + "".join(f" `{o}`" for o in EXTRA.get(arm, [])),
                     f"{r['trainable']:,}" + ratio(r["trainable"], full.get("trainable"), "{:.4f}"),
                     f"{r['frozen_bytes'] / 2**20:,.1f}",
                     "–" if r["optimizer_bytes"] is None else f"{r['optimizer_bytes'] / 2**20:,.2f}"
                     + ratio(r["optimizer_bytes"], full.get("optimizer_bytes"), "{:.4f}"),
                     f"{r['peak_mem_mb']:,.0f}" + ratio(r["peak_mem_mb"], full.get("peak_mem_mb"), "{:.2f}"),
                     f"{rate:,.0f}{paired_ratio}"])
    return markdown_table(["arm", "trainable params", "frozen weights (MiB)", "optimizer state (MiB)",
                           "peak memory (MiB)", "tokens/s"], rows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--quick", action="store_true", help="--size tiny --warmup 1 --steps 2 --out '' (a test)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of full,lora,qlora,lora_compiled")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of tokens/s")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--cpu", action="store_true", help="hide any GPU from the runs")
    parser.add_argument("--out", default="peft.md", help="file name under --out-dir ('' writes nothing)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    parser.add_argument("--keep-base", type=Path, default=None, help="write the base model here and keep it")
    parser.add_argument("--no-save", dest="save", action="store_false",
                        help="no checkpoint or model/ (seconds at 0.27B): the optimizer-state column stays empty")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.size, args.warmup, args.steps, args.out = "tiny", 1, 2, ""
    return args


def main() -> None:
    args = parse_args()
    size, arms = SIZES[args.size], [a for a in args.arms.split(",") if a]
    if args.worker:
        print(json.dumps(worker_prepare(Path(args.base), size, arms, args.precision)), flush=True)
        return
    env = {"HF_HUB_OFFLINE": "1", **({"CUDA_VISIBLE_DEVICES": ""} if args.cpu else {})}
    rates, paired = {a: Series() for a in arms}, {a: Series() for a in arms}
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        base = args.keep_base.resolve() if args.keep_base else Path(tmp) / "base"
        prep = run_process([PY, __file__, "--worker", "prepare", "--base", str(base), "--size", args.size,
                            "--arms", ",".join(arms), "--precision", args.precision], env=env)
        if prep.returncode != 0 or not prep.data:
            sys.exit(f"building the base model failed (exit {prep.returncode}):\n{prep.tail}")
        results = {arm: {"frozen_bytes": prep.data["frozen_bytes"][arm]} for arm in arms}
        for r in range(args.rounds):
            round_rates = {}
            for arm in [a for a in rotated(arms, r) if a not in failed]:
                figures = run_arm(arm, base, size, args.warmup, args.steps, args.precision, env, args.save)
                if not figures:  # the others still run: one broken arm must not hide the rest
                    failed.append(arm)
                    continue
                results[arm].update(figures)
                round_rates[arm] = figures["tokens_per_sec"]
                rates[arm].values.append(figures["tokens_per_sec"])
                print(f"round {r + 1}: {arm:6s} {figures['tokens_per_sec']:9,.0f} tok/s  peak "
                      f"{figures['peak_mem_mb']:8,.0f} MiB", file=sys.stderr, flush=True)
            for arm, rate in round_rates.items():
                if round_rates.get("full"):
                    paired[arm].values.append(rate / round_rates["full"])
    total = prep.data["total"]
    done = {arm: r for arm, r in results.items() if arm not in failed}
    header = (f"Measured {utc_now()} on {prep.data['device']}; {versions()}. A random-init Llama of "
              f"{total:,} parameters ({json.dumps(size.model)}), micro-batch {size.batch_size} x {size.seq_len} "
              f"tokens of the stdlib data, precision={args.precision}, AdamW; {args.rounds} round(s) of "
              f"{args.warmup} warm-up + {args.steps} timed steps per arm, each arm a fresh `python -m llmexp`. "
              f"Load average at the end: {load_average()}. Ratios to full fine-tuning in parentheses.")
    if any(r.get("bf16_emulated") for r in done.values()):
        header += (" This CPU has no native bf16 (AVX512-BF16 or AMX): torch emulates it, so these tokens/s are"
                   " far below what the same CPU does in fp32; the parameter and byte columns do not depend on it.")
    if args.json:
        overrides = {arm: arm_overrides(arm, base, size, args.warmup + args.steps, args.precision, args.save)
                     for arm in arms}
        print(json.dumps({"total_params": total, "arms": done, "failed": failed, "overrides": overrides}))
    if done:
        if args.out:
            args.out_dir.mkdir(parents=True, exist_ok=True)
        publish(f"{header}\n\n{render(done, rates, paired)}", args.out, args.out_dir)
    if failed:
        sys.exit(f"{', '.join(failed)}: the run failed" + ("" if done else "; no table"))


if __name__ == "__main__":
    main()
