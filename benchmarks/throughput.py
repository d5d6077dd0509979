"""The same training work four ways, alternately in fresh processes, with paired ratios.

    (a) raw      a hand-written PyTorch loop (LlamaForCausalLM.from_config, bf16 autocast, torch AdamW,
                 HF's own loss, clip_grad_norm_, random tokens already in memory)
    (b) llmexp   `python -m llmexp` with equivalent overrides; tokens/s read from metrics.jsonl
    (c) hf       HF Trainer with equivalent TrainingArguments (bf16, fused AdamW, clipping, cosine)
    (d) compile  llmexp with train.compile=true (its compile step is reported apart)

The work: the `tiny` model, micro-batch 8 x 256 tokens, bf16 autocast, AdamW, grad clipping at 1.0.
Each round measures a bf16 matmul ceiling for MFU first (a round cut short keeps it), then runs every arm once, in a
rotated order; the first `--warmup` steps of every arm are not timed, and llmexp's arms write no final checkpoint
(`train.save_final=false`). Ratios to (a) are paired within each round. On a GPU the datasheet's dense bf16 peak
(`llmexp.monitor.throughput.DATASHEET_TFLOPS`) gives a second MFU, the one other frameworks print.

    python benchmarks/throughput.py                       # 3 rounds x (10 warm-up + 30 timed steps)
    python benchmarks/throughput.py --rounds 5 --steps 60
    python benchmarks/throughput.py --arms raw,llmexp --rounds 1 --steps 5 --warmup 5   # a smoke run
    python benchmarks/throughput.py --model 1b --seq-len 2048 --rounds 2 --out throughput_gpu.md  # a GPU

Every arm runs on CUDA when torch sees a GPU (the ceiling is then a bf16 matmul on it), else on the CPU.
`--model 1b` is a ~1.0B-parameter Llama (hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192; the
tiny model's 8192-word vocabulary), for GPUs: step 2 of benchmarks/gpu/run.sh runs it at `--seq-len 2048`.
`--model micro` is the test suite's 2-layer, 64-wide model (vocabulary 512), for checking the path.
Positions: max(256, --seq-len) for every arm alike.

Writes the table to benchmarks/results/throughput.md as well; `--json FILE` also writes the figures so far
after every arm (so a run cut short keeps what it measured), with the peak GPU memory of each arm
(torch.cuda.max_memory_allocated; llmexp's summary.json `peak_mem_mb`) when it ran on CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    PY,
    ArmResult,
    Series,
    flops_per_token,
    llama_config,
    llmexp_tokens_per_sec,
    load_average,
    load_records,
    markdown_table,
    measure_ceiling_tflops,
    publish,
    rotated,
    run_process,
    utc_now,
)

ARMS = ("raw", "llmexp", "hf", "compile")
LABELS = {"raw": "(a) hand-written loop", "llmexp": "(b) llmexp", "hf": "(c) HF Trainer",
          "compile": "(d) llmexp, train.compile=true"}
MICRO_BATCH, SEQ_LEN, LR = 8, 256, 3e-4
MODELS: dict[str, dict[str, int]] = {
    "tiny": {},  # llmexp/conf/model/tiny.yaml as it is
    "micro": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 512},  # tests/conftest.py's TINY: the path, not figures
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 8192},
}
"""Fields changed from the tiny model's, for every arm alike (llmexp gets them as model.* overrides)."""


def model_fields(model_name: str) -> dict[str, int]:
    """MODELS[model_name] with positions for the sequence length (the tiny model's 256 at least)."""
    return {**MODELS[model_name], "max_position_embeddings": max(256, SEQ_LEN)}


def peak_cuda_mb() -> float | None:
    """torch.cuda.max_memory_allocated in MiB (what llmexp's summary.json `peak_mem_mb` holds on CUDA)."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def datasheet_tflops() -> float | None:
    """This GPU's dense bf16 peak from its datasheet (llmexp's table), None on a CPU or an unlisted card."""
    import torch

    from llmexp.monitor.throughput import datasheet_peak

    sheet = datasheet_peak(torch.cuda.get_device_name(), torch.bfloat16) if torch.cuda.is_available() else None
    return sheet[1] if sheet else None


def stamp() -> float:
    """A step's end: on a GPU only once its kernels are done."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


# ---------------------------------------------------------------- workers (run in fresh processes)


def random_batches(num_steps: int, vocab_size: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (num_steps, MICRO_BATCH, SEQ_LEN), generator=gen)


def worker_raw(warmup: int, steps: int, model_name: str) -> dict[str, Any]:
    """The loop a user writes from the seed: HF's loss, autocast, clip, step, zero_grad."""
    import torch
    from transformers import LlamaForCausalLM, get_cosine_schedule_with_warmup

    torch.manual_seed(0)
    config = llama_config(**model_fields(model_name))
    device = device_type()
    with torch.device(device):  # initialised where it trains: a 1B init on the CPU takes seconds, untimed but spent
        model = LlamaForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scheduler = get_cosine_schedule_with_warmup(optimizer, max(1, (warmup + steps) // 20), warmup + steps)
    data = random_batches(warmup + steps, config.vocab_size).to(device)
    stamps = []
    for step in range(warmup + steps):
        batch = data[step]
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 10 == 0:
            print(f"step {step + 1} loss {loss.item():.4f}", flush=True)  # a loop logs now and then
        stamps.append(stamp())
    tokens = steps * MICRO_BATCH * SEQ_LEN
    num_params = sum(p.numel() for p in model.parameters())
    return {"tokens_per_sec": tokens / (stamps[-1] - stamps[warmup - 1]), "num_params": num_params,
            "embed_params": model.get_input_embeddings().weight.numel(), "num_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size, "peak_mem_mb": peak_cuda_mb()}


def worker_hf(warmup: int, steps: int, model_name: str) -> dict[str, Any]:
    """HF Trainer on the same work; step ends are stamped by a callback."""
    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(0)
    config = llama_config(**model_fields(model_name))
    with torch.device(device_type()):  # as in worker_raw; the Trainer finds it on its device already
        model = LlamaForCausalLM(config)
    data = random_batches(warmup + steps, config.vocab_size).reshape(-1, SEQ_LEN)
    dataset = [{"input_ids": row, "labels": row} for row in data]
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            stamps.append(stamp())

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=MICRO_BATCH, max_steps=warmup + steps, bf16=True,
            learning_rate=LR, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="cosine",
            warmup_steps=max(1, (warmup + steps) // 20), logging_steps=10, save_strategy="no", eval_strategy="no",
            report_to="none", use_cpu=device_type() == "cpu", dataloader_num_workers=0, optim="adamw_torch_fused",
            disable_tqdm=True, seed=0)
        Trainer(model=model, args=args, train_dataset=dataset, callbacks=[Stamp()]).train()
    tokens = steps * MICRO_BATCH * SEQ_LEN
    return {"tokens_per_sec": tokens / (stamps[-1] - stamps[warmup - 1]), "peak_mem_mb": peak_cuda_mb()}


def worker_ceiling() -> dict[str, Any]:
    return {"ceiling_tflops": measure_ceiling_tflops(device=device_type())}


# ---------------------------------------------------------------- the parent: rounds and the table


def llmexp_overrides(warmup: int, steps: int, compile_model: bool, model_name: str = "tiny",
                     max_examples: int | None = None) -> list[str]:
    total = warmup + steps
    limit = [f"data.max_examples={max_examples}"] if max_examples else []
    return ["model=tiny", *(f"model.{k}={v}" for k, v in model_fields(model_name).items()), "data=stdlib", *limit,
            "precision=bf16", "optimizer=adamw", f"batch_size={MICRO_BATCH}",
            f"data.max_length={SEQ_LEN}", f"lr={LR}", f"train.max_steps={total}",
            f"train.warmup_steps={max(1, total // 20)}", f"train.logging_steps={math.gcd(warmup, steps)}",
            "train.eval_steps=1000000", "train.eval_batches=1", "train.save_steps=0", "train.resume=never",
            "train.peak_tflops=1", f"train.compile={str(compile_model).lower()}", "train.save_final=false"]


def run_arm(arm: str, warmup: int, steps: int, threads: int = 0, model_name: str = "tiny",
            max_examples: int | None = None) -> ArmResult:
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    if arm in ("raw", "hf", "ceiling"):
        return run_process([PY, __file__, "--worker", arm, "--warmup", str(warmup), "--steps", str(steps),
                            "--model", model_name, "--seq-len", str(SEQ_LEN), "--micro-batch", str(MICRO_BATCH)],
                           env=env)
    overrides = llmexp_overrides(warmup, steps, arm == "compile", model_name, max_examples)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        result = run_process([PY, "-m", "llmexp", *overrides, f"hydra.run.dir={run_dir}"], env=env)
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        result.data = {"tokens_per_sec": llmexp_tokens_per_sec(run_dir, warmup),
                       "num_params": summary.get("num_params"), "compile_time_s": summary.get("compile_time_s"),
                       "steps_logged": sum(r.get("event") == "train" for r in load_records(run_dir)),
                       "peak_mem_mb": summary.get("peak_mem_mb") if device_type() == "cuda" else None}
    return result


def run_rounds(arms: list[str], rounds: int, warmup: int, steps: int, threads: int = 0,
               model_name: str = "tiny", max_examples: int | None = None,
               after_arm: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every arm once per round, rotated; `after_arm` sees the results so far after each arm."""
    rates = {arm: Series() for arm in arms}
    ratios = {arm: Series() for arm in arms}
    rss = {arm: Series() for arm in arms}
    gpu_mem: dict[str, Series] = {arm: Series() for arm in arms}
    compile_s, ceilings, model_info, loads, per_round = Series(), Series(), {}, [], []
    failures: list[str] = []
    results = {"rates": rates, "ratios": ratios, "rss": rss, "gpu_mem": gpu_mem, "compile_s": compile_s,
               "ceilings": ceilings, "model": model_info, "loads": loads, "per_round": per_round,
               "failures": failures}
    for r in range(rounds):
        round_rates: dict[str, float] = {}
        per_round.append(round_rates)
        for arm in ["ceiling", *rotated(arms, r)]:  # the ceiling first: a compile arm cut short cannot cost it
            res = run_arm(arm, warmup, steps, threads, model_name, max_examples)
            if res.returncode != 0 or not res.data:
                print(f"round {r + 1}: {arm} failed (exit {res.returncode}):\n{res.tail}", file=sys.stderr)
                failures.append(f"round {r + 1}: {arm} (exit {res.returncode})")
                continue
            if arm == "ceiling":
                ceilings.values.append(res.data["ceiling_tflops"])
                continue
            rate = float(res.data["tokens_per_sec"])
            round_rates[arm] = rate
            rates[arm].values.append(rate)
            rss[arm].values.append(res.peak_rss_mb)
            if res.data.get("peak_mem_mb") is not None:
                gpu_mem[arm].values.append(float(res.data["peak_mem_mb"]))
            if arm == "raw":
                model_info.update(res.data)
            if arm == "compile" and res.data.get("compile_time_s"):
                compile_s.values.append(float(res.data["compile_time_s"]))
            print(f"round {r + 1}: {arm:8s} {rate:9,.0f} tok/s  peak RSS {res.peak_rss_mb:6,.0f} MB  "
                  f"wall {res.wall_s:5.1f} s", file=sys.stderr, flush=True)
            if after_arm is not None:
                after_arm(results)
        if "raw" in round_rates:
            for arm, rate in round_rates.items():
                ratios[arm].values.append(rate / round_rates["raw"])
        loads.append(load_average())
        if after_arm is not None:
            after_arm(results)
    return results


def mfu_columns(rate: float, model: dict[str, Any], ceiling_tflops: float) -> tuple[str, str]:
    if not model or not ceiling_tflops:
        return "–", "–"
    n, emb = model["num_params"], model["embed_params"]
    full = flops_per_token(n, model["num_layers"], model["hidden_size"], SEQ_LEN)
    no_emb = flops_per_token(n - emb, model["num_layers"], model["hidden_size"], SEQ_LEN)
    peak = ceiling_tflops * 1e12
    return f"{rate * full / peak:.1%}", f"{rate * no_emb / peak:.1%}"


def mfu_value(rate: float, model: dict[str, Any], ceiling_tflops: float) -> float | None:
    """MFU as a number (6N + attention FLOPs per token over the measured ceiling), None without both."""
    if not model or not ceiling_tflops or not math.isfinite(ceiling_tflops) or not math.isfinite(rate):
        return None
    full = flops_per_token(model["num_params"], model["num_layers"], model["hidden_size"], SEQ_LEN)
    return rate * full / (ceiling_tflops * 1e12)


def figures(results: dict[str, Any], arms: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The figures so far as plain JSON: per arm the rates of each round, the paired ratios to (a), MFU."""
    ceiling = results["ceilings"].median()
    sheet = datasheet_tflops()
    out: dict[str, Any] = {
        "model": args.model, "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH, "warmup": args.warmup,
        "steps": args.steps, "rounds": args.rounds, "device": device_type(),
        "num_params": results["model"].get("num_params"), "ceiling_tflops": results["ceilings"].values,
        "compile_s": results["compile_s"].values, "per_round": results["per_round"],
        "failures": results["failures"], "datasheet_tflops": sheet, "arms": {}}
    for arm in arms:
        rate = results["rates"][arm].median()
        out["arms"][arm] = {
            "label": LABELS[arm], "tokens_per_sec": results["rates"][arm].values,
            "ratio_to_raw": results["ratios"][arm].values, "peak_rss_mb": results["rss"][arm].values,
            "peak_gpu_mem_mb": results["gpu_mem"][arm].values,
            "mfu": mfu_value(rate, results["model"], ceiling) if results["rates"][arm].values else None,
            "mfu_datasheet": mfu_value(rate, results["model"], sheet) if sheet and results["rates"][arm].values
            else None}
    return out


def render(results: dict[str, Any], arms: list[str], args: argparse.Namespace) -> str:
    ceiling = results["ceilings"].median()
    rows = []
    for arm in arms:
        rate = results["rates"][arm].median()
        ratio = results["ratios"][arm]
        mfu, mfu_no_emb = mfu_columns(rate, results["model"], ceiling if math.isfinite(ceiling) else 0.0)
        note = ""
        if arm == "compile" and results["compile_s"].values:
            note = f"first step (compile) {results['compile_s'].median():.1f} s, not timed"
        rows.append([LABELS[arm], f"{rate:,.0f}", results["rates"][arm].spread(),
                     f"{ratio.median():.3f}× ({ratio.spread('{:.3f}')})" if ratio.values else "–",
                     mfu, mfu_no_emb, f"{results['rss'][arm].median():,.0f}", note])
    table = markdown_table(["config", "tokens/s (median)", "spread (min–max)", "ratio to (a), paired",
                            "MFU", "MFU, input embedding left out of N", "peak RSS (MB)", "note"], rows)
    n = results["model"].get("num_params", 0)
    head = (f"Measured {utc_now()}, {args.rounds} rounds of {args.warmup} warm-up + {args.steps} timed steps per "
            f"arm, {args.model} model ({n / 1e6:.2f}M params) on {device_type()}, "
            f"micro-batch {MICRO_BATCH} x {SEQ_LEN}, bf16 autocast, AdamW. "
            f"bf16 matmul ceiling {ceiling:.3f} TFLOP/s (median of rounds, {results['ceilings'].spread('{:.3f}')}). "
            f"Load average after each round: {'; '.join(results['loads'])}.")
    pairs = [r["llmexp"] / r["hf"] for r in results["per_round"] if r.get("llmexp") and r.get("hf")]
    if pairs:
        head += f" llmexp / HF Trainer, paired within rounds: {statistics.median(pairs):.3f}× (median)."
    return head + "\n\n" + table


def main() -> None:
    global SEQ_LEN, MICRO_BATCH  # the run's shape: every function here (and every worker) reads them
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of every arm")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per arm")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny", help="tiny, or ~1B for GPUs")
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for every arm (0: torch's default)")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN, help="tokens per example, every arm")
    parser.add_argument("--micro-batch", type=int, default=MICRO_BATCH, help="examples per step, every arm")
    parser.add_argument("--max-examples", type=int, default=None,
                        help="llmexp's data.max_examples: fewer stdlib files to tokenise (a smoke run)")
    parser.add_argument("--out", default="throughput.md", help="file name under benchmarks/results/ ('' skips)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here, after every arm")
    parser.add_argument("--worker", choices=["raw", "hf", "ceiling"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    SEQ_LEN, MICRO_BATCH = args.seq_len, args.micro_batch
    if args.worker:
        workers = {"raw": lambda: worker_raw(args.warmup, args.steps, args.model),
                   "hf": lambda: worker_hf(args.warmup, args.steps, args.model), "ceiling": worker_ceiling}
        result = workers[args.worker]()
        print(json.dumps(result), flush=True)
        return
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; pick from {', '.join(ARMS)}")
    def write_json(results: dict[str, Any]) -> None:
        if args.json is not None:
            tmp = args.json.with_suffix(".tmp")
            tmp.write_text(json.dumps(figures(results, arms, args), indent=1))
            tmp.replace(args.json)  # a reader never sees half a file

    results = run_rounds(arms, args.rounds, args.warmup, args.steps, args.threads, args.model, args.max_examples,
                         write_json)
    publish(render(results, arms, args), args.out)


if __name__ == "__main__":
    main()
