"""One step of the GPU check (benchmarks/gpu/run.sh runs them in order, one process each):

    python benchmarks/gpu/steps.py N --work DIR --budget SECONDS [--tiny]

Each step reaches llmexp only through its command line (`python -m llmexp`, `python -m llmexp.estimate`) and
the files a run writes (metrics.jsonl, summary.json, sweep_summary.json), or through the benchmark scripts that
already do a step's work (benchmarks/throughput.py, benchmarks/adapters.py), so that llmexp's modules can move
without breaking the kit. It writes DIR/steps/N.json after every sub-run: {"step", "title", "figures",
"verdict", "lines"} (lines: the step's markdown for gpu.md), so a step cut short still reports what it did.

Exit codes: 0 done, 124 its budget ran out (the figures so far are kept), 1 anything else (the error is in
the log). `KIT_FAIL_STEP=N[,M]` makes step N fail at once (the test of the kit's own error path).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmexp.report.formats import md_table

REPO = Path(__file__).resolve().parents[2]
BASE_MODEL = Path(__file__).with_name("base_model.py")
PROBE = Path(__file__).with_name("probe.py")
PY = sys.executable
EXIT_TIMEOUT = 124  # what `timeout` returns: run.sh reads both alike


class StepTimeout(Exception):
    """The step's budget ran out during a sub-run (which was killed)."""


# ---------------------------------------------------------------- the two sizes of every step


@dataclass(frozen=True)
class Profile:
    """What each step runs: the GPU's figures, or the same path with a tiny model on a CPU (`--tiny`)."""

    name: str
    small: tuple[str, ...]
    """Overrides for runs whose subject is not the model's size (the headline commands, kill and resume)."""
    headline: tuple[str, ...]
    """Appended to the headline commands: nothing on a GPU (they run as written)."""
    multirun: tuple[str, ...]
    """Appended to the multirun, whose subject is the launcher placing its jobs: shorter jobs, no final save."""
    auto: tuple[str, ...]
    """Appended to the batch_size=auto run."""
    mid_model: dict[str, int]
    """The model of steps 3, 5 and 7 (fused head, FSDP, batch_size=auto), built from the config: ~0.27B on a GPU,
    large enough that its steps, not the process's start, dominate, small enough to build and save in seconds."""
    mid_data: tuple[str, ...]
    """Its data: sequence 2048 on a GPU."""
    mid_batch: int
    precision: str
    timed: tuple[int, int]
    """(warm-up, timed) steps of every throughput arm: the warm-up is left out of tokens/s."""
    throughput: tuple[str, ...]
    adapters: tuple[str, ...]
    resume: tuple[int, int, int]
    """Kill and resume: (max_steps, save_steps, the step after which the kill lands)."""
    reruns: int
    """Uninterrupted runs in step 8: two measure the run-to-run noise a resumed run is held to."""
    head_vocab: int
    """Step 3's vocabulary: the head's share of the work grows with it."""

    @property
    def mid(self) -> tuple[str, ...]:
        return (*fields_overrides(self.mid_model), *self.mid_data)

    @property
    def seq_len(self) -> int:
        return next(int(o.split("=")[1]) for o in self.mid_data if o.startswith("data.max_length="))


RUN = ("train.eval_steps=1000000", "train.eval_batches=1", "train.save_steps=0", "train.resume=never",
       "train.logging_steps=1", "train.save_final=false")
"""Every measured run: no evals (none at step 0 either: eval_steps is beyond the run) or checkpoints inside the timed
steps, no final checkpoint or model/, one train record a step."""
MID_FIELDS = {"hidden_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
              "intermediate_size": 4096, "vocab_size": 8192, "max_position_embeddings": 2048}
"""0.27B parameters with the default tokenizer's vocabulary (a from-config run trains its BPE to model.vocab_size:
8192 is the one step 1 has cached). Step 2 uses its script's ~1B model, step 4 its script's `mid` size (this one)."""
TINY_FIELDS = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
               "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 64}
"""tests/conftest.py's TINY model: one tokenizer (vocabulary 512) for every step of the tiny path."""


def fields_overrides(fields: dict[str, int]) -> tuple[str, ...]:
    return tuple(f"model.{k}={v}" for k, v in fields.items())


GPU = Profile(
    name="gpu",
    small=(),  # the tiny model as configured: llmexp's default run
    headline=(),
    multirun=("train.max_steps=50", "train.save_final=false"),
    auto=(),
    mid_model=MID_FIELDS,
    mid_data=("data.max_length=2048",),
    mid_batch=8,
    precision="bf16",
    timed=(3, 8),  # ~0.4 s a step of 8 x 2048 tokens at ~40k tokens/s: 8 timed steps are ~3 s of work
    throughput=("--model", "1b", "--seq-len", "2048", "--micro-batch", "8", "--warmup", "3", "--steps", "8"),
    # lora_compiled: the first run's LoRA ran at 0.46x full's speed, host-bound (twice full's ops a step,
    # benchmarks/ops_per_step.py); the per-block compile is the remedy the docs name, measured here
    adapters=("--size", "mid", "--arms", "full,lora,qlora,lora_compiled", "--warmup", "3", "--steps", "8",
              "--no-save"),
    resume=(200, 50, 70),  # tiny model steps take ~15 ms on a GPU: the kill lands in a 130-step window
    reruns=2,
    head_vocab=32000,  # Llama-2's (the seed's model): the head is ~12% of the matmuls, fp32 logits 2 GB a step
)
TINY = Profile(
    name="tiny",
    small=(*fields_overrides(TINY_FIELDS), "data.max_length=64", "data.max_examples=60", "batch_size=4",
           "train.eval_batches=1", "train.peak_tflops=1"),  # a peak given: no ceiling measured at start
    headline=("train.max_steps=2",),
    multirun=("train.max_steps=2", "train.save_final=false"),
    auto=("train.global_batch_size=8",),  # candidates 8, 4, 2, 1: a small probe (the cap is the global batch)
    mid_model=TINY_FIELDS,
    mid_data=("data.max_length=64", "data.max_examples=60", "train.peak_tflops=1"),
    mid_batch=4,
    precision="fp32",  # bf16 may be emulated on a CPU (slow without AVX512-BF16); the path is the same
    timed=(1, 2),
    throughput=("--model", "micro", "--seq-len", "64", "--micro-batch", "4", "--warmup", "1", "--steps", "2",
                "--arms", "raw,llmexp", "--max-examples", "60"),
    adapters=("--size", "tiny", "--arms", "full,lora,qlora", "--warmup", "1", "--steps", "1"),  # saves: its
    # optimizer.pt is measured (the test checks 8 bytes a trained parameter); a GPU's 4 GB checkpoints are not
    resume=(12, 4, 5),
    reruns=1,
    head_vocab=512,
)


# ---------------------------------------------------------------- the step's record and its sub-runs


@dataclass
class Record:
    """What a step measured so far; saved after every sub-run."""

    step: int
    title: str
    path: Path
    figures: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    verdict: str = ""
    seconds: dict[str, dict[str, float | None]] = field(default_factory=dict)
    """Each sub-run's wall seconds and, for an llmexp run, where they went (its start record's `process_s` and
    `setup_s`): what the next resizing of the budgets reads."""

    def save(self) -> None:
        data = {"step": self.step, "title": self.title, "figures": self.figures, "verdict": self.verdict,
                "lines": self.lines, "seconds": self.seconds}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(self.path)  # run.sh's report reads it at any moment


@dataclass
class Proc:
    returncode: int
    output: str
    seconds: float


@dataclass
class Ctx:
    """A step's work directory, profile, deadline and record."""

    work: Path
    profile: Profile
    deadline: float
    record: Record
    cpu: bool
    rounds: int = 1

    @property
    def dir(self) -> Path:
        path = self.work / f"step{self.record.step}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def env(self) -> dict[str, str]:
        env = {**os.environ, "LLMEXP_NO_BAR": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        if self.cpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def run(self, cmd: Sequence[str], name: str, *, poll: Callable[[subprocess.Popen[str]], None] | None = None,
            env: dict[str, str] | None = None) -> Proc:
        """`cmd` in a session of its own, its output in logs/NAME.log (and echoed to ours), killed with its
        children when the step's deadline comes (StepTimeout). `poll` is called every 10 ms while it runs."""
        log = self.work / "logs" / f"step{self.record.step}_{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"$ {' '.join(cmd)}", flush=True)
        started = time.monotonic()
        with open(log, "w") as out:
            proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                    env=env or self.env(), start_new_session=True)
            try:
                while proc.poll() is None:
                    if time.time() > self.deadline:
                        raise StepTimeout(f"{name}: the step's budget ran out")
                    if poll is not None:
                        poll(proc)
                    time.sleep(0.01)
            finally:
                stop(proc)
                self.record.seconds[name] = {"wall_s": round(time.monotonic() - started, 1)}
                self.record.save()
        text = log.read_text(errors="replace")
        sys.stdout.write(text[-4000:])
        return Proc(proc.returncode, text, time.monotonic() - started)

    def llmexp(self, overrides: Sequence[str], run_dir: Path, name: str, *,
               prefix: Sequence[str] = (PY, "-m", "llmexp"), **kwargs: Any) -> Proc:
        """`python -m llmexp OVERRIDES hydra.run.dir=RUN_DIR` (or under another launcher, `prefix`)."""
        try:
            return self.run([*prefix, *overrides, f"hydra.run.dir={run_dir}"], name, **kwargs)
        finally:
            start = records(run_dir, "start")[-1:] or [{}]  # the last start: a resumed run's own
            self.record.seconds[name].update(
                imports_s=minus(start[0].get("process_s"), start[0].get("setup_s")),
                setup_s=start[0].get("setup_s"), run_s=summary(run_dir).get("time_s"))
            self.record.save()


def stop(proc: subprocess.Popen[str], grace_s: float = 4.0) -> None:
    """End a sub-run that is still running: SIGTERM to its session first, because llmexp's local launcher runs
    each job in a session of its own and passes SIGTERM on to them (a SIGKILL would leave them running on the
    GPU), then SIGKILL to whatever is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue


def minus(a: float | None, b: float | None) -> float | None:
    return round(a - b, 2) if a is not None and b is not None else None


def need(proc: Proc, what: str) -> None:
    """Raise with the output's tail unless `proc` exited 0."""
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited {proc.returncode}:\n{proc.output[-2500:]}")


# ---------------------------------------------------------------- what a run leaves behind (plain files)


def records(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line being written right now
            continue
        if event is None or record.get("event") == event:
            out.append(record)
    return out


def summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def tokens_per_sec(run_dir: Path, warmup: int) -> float:
    """Tokens/s over the train records after the warm-up steps: each record's rate covers the steps since
    the previous record (as benchmarks/common.llmexp_tokens_per_sec reads them), so the windows' seconds add."""
    steps = seconds = 0.0
    previous = 0
    for r in records(run_dir, "train"):
        step, rate = int(r["step"]), float(r["tokens_per_sec"])
        window, previous = step - previous, step
        if step > warmup and rate > 0:
            steps += window
            seconds += window / rate
    return steps / seconds if seconds else 0.0  # tokens/s: every step holds as many tokens


def run_figures(run_dir: Path, warmup: int) -> dict[str, Any]:
    """The figures every step reports of a finished run."""
    s = summary(run_dir)
    start = next(iter(records(run_dir, "start")), {})
    return {"status": s.get("status"), "exit_code": s.get("exit_code"), "steps": s.get("step"),
            "device": start.get("device"), "precision": s.get("precision"), "optimizer": start.get("optimizer"),
            "tokens_per_sec": tokens_per_sec(run_dir, warmup), "peak_mem_mb": s.get("peak_mem_mb"),
            "mfu": s.get("mfu"), "train_loss": s.get("train_loss"), "eval_loss": s.get("eval_loss"),
            "num_params": s.get("num_params"), "total_params": s.get("total_params")}


def prune(run_dir: Path, keep_model: bool = False) -> None:
    """Drop a read run's checkpoints and model/ (gigabytes at 1B, in memory when the work dir is /dev/shm)."""
    for name in ("checkpoints", "dcp", *(() if keep_model else ("model",))):
        shutil.rmtree(run_dir / name, ignore_errors=True)


def fmt(value: Any, spec: str = ",.0f", unit: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:{spec}}{unit}"


def ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return {}


# ---------------------------------------------------------------- 1: the README's headline commands


def step_headline(ctx: Ctx) -> None:
    """`python -m llmexp optimizer=adamw8bit precision=bf16` as written, then a two-job `--multirun lr=...`
    through the local launcher (on one GPU the second job waits for the first)."""
    p, rec = ctx.profile, ctx.record
    run_dir, probe = ctx.dir / "adamw8bit", ctx.dir / "adamw8bit_probe.json"
    proc = ctx.llmexp(["optimizer=adamw8bit", "precision=bf16", *p.small, *p.headline], run_dir, "adamw8bit",
                      prefix=(PY, str(PROBE), str(probe), "--"))  # `python -m llmexp` in a watched process
    single = {**run_figures(run_dir, warmup=1), "exit": proc.returncode, "wall_s": round(proc.seconds, 1),
              "syncs": probed(probe).get("median")}
    evals = records(run_dir, "eval")
    single["eval_ppl_first_last"] = [evals[0].get("eval_ppl"), evals[-1].get("eval_ppl")] if evals else None
    rec.figures["adamw8bit"] = single
    rec.save()
    sweep_dir = ctx.dir / "sweep"
    sweep = ctx.run([PY, "-m", "llmexp", "--multirun", "lr=1e-5,3e-5", *p.small, *p.multirun,
                     f"hydra.sweep.dir={sweep_dir}"], "multirun")
    summary_path = sweep_dir / "sweep_summary.json"
    jobs = json.loads(summary_path.read_text()).get("jobs", []) if summary_path.exists() else []
    rec.figures["multirun"] = {"exit": sweep.returncode, "wall_s": round(sweep.seconds, 1), "jobs": [
        {"job": j.get("job"), "status": j.get("status"), "lr": (j.get("params") or {}).get("lr"),
         "eval_loss": j.get("eval_loss"), "tokens_per_sec": j.get("tokens_per_sec"),
         "device": next(iter(records(Path(j["dir"]), "start")), {}).get("device") if j.get("dir") else None}
        for j in jobs]}
    launcher = [line.split("[HYDRA]", 1)[1].split("): ", 1)[0].strip() + ")"  # "#0 started (pid 1, GPU 0)"
                for line in sweep.output.splitlines() if " started (pid" in line]
    rec.figures["multirun"]["launcher_lines"] = launcher
    prune(run_dir, keep_model=True)  # the tiny model's model/ (30 MB) holds the tokenizer step 3 uses
    for j in jobs:
        prune(Path(j.get("dir", "")))
    ppl = single["eval_ppl_first_last"] or [None, None]
    rec.lines = [
        f"`python -m llmexp optimizer=adamw8bit precision=bf16`: exit {proc.returncode}, {single['status']}, "
        f"{single['steps']} steps on {single['device']} in {single['wall_s']} s; eval ppl {fmt(ppl[0])} → "
        f"{fmt(ppl[1])}; {fmt(single['tokens_per_sec'])} tokens/s; peak memory {fmt(single['peak_mem_mb'])} MiB.",
        sync_line(single["syncs"], "bitsandbytes' per-parameter `torch.cuda.synchronize()` included"),
        f"`python -m llmexp --multirun lr=1e-5,3e-5`: exit {sweep.returncode} in {sweep.seconds:.1f} s; jobs: "
        + "; ".join(f"#{j['job']} lr={j['lr']} {j['status']} on {j['device']}" for j in rec.figures["multirun"]["jobs"])
        + f" (each `{' '.join(p.multirun)}`: the launcher is the subject)"
        + (f". Launcher: {' / '.join(launcher)}" if launcher else ""),
    ]
    ok = proc.returncode == 0 and single["status"] == "completed" and sweep.returncode == 0 and len(jobs) == 2 \
        and all(j.get("status") == "completed" for j in jobs)
    rec.verdict = "both run as written" if ok else "a headline command did not complete: see the log"
    rec.save()
    need(proc, "python -m llmexp optimizer=adamw8bit precision=bf16")
    need(sweep, "python -m llmexp --multirun lr=1e-5,3e-5")


# ---------------------------------------------------------------- 2: throughput and MFU (benchmarks/throughput.py)


def step_throughput(ctx: Ctx) -> None:
    """benchmarks/throughput.py's four arms in paired rounds; its --json file is read even if it is cut short."""
    rec, out = ctx.record, ctx.dir / "throughput.json"
    out.unlink(missing_ok=True)
    env = {**ctx.env(), "TMPDIR": str(ctx.dir)}  # its run directories: in the work dir (/dev/shm on a GPU)
    try:
        proc = ctx.run([PY, "benchmarks/throughput.py", *ctx.profile.throughput, "--rounds", str(ctx.rounds),
                        "--out", "", "--json", str(out)], "throughput", env=env)
    finally:
        if out.exists():
            throughput_lines(rec, json.loads(out.read_text()))
            rec.save()
    need(proc, "benchmarks/throughput.py")


def throughput_lines(rec: Record, figs: dict[str, Any]) -> None:
    rec.figures = figs
    rows = []
    for a in figs["arms"].values():
        ratios = a["ratio_to_raw"]
        rows.append([a["label"], fmt(statistics.median(a["tokens_per_sec"])) if a["tokens_per_sec"] else "–",
                     " / ".join(fmt(v) for v in a["tokens_per_sec"]),
                     f"{statistics.median(ratios):.3f}× ({' / '.join(f'{r:.3f}' for r in ratios)})" if ratios else "–",
                     fmt(a["mfu"], ".1%") + (f" ({fmt(a.get('mfu_datasheet'), '.1%')} of the datasheet)"
                                              if a.get("mfu_datasheet") is not None else ""),
                     fmt(max(a["peak_gpu_mem_mb"]) if a["peak_gpu_mem_mb"] else None)])
    pairs = [r["llmexp"] / r["hf"] for r in figs["per_round"] if r.get("llmexp") and r.get("hf")]
    compile_pairs = [r["compile"] / r["llmexp"] for r in figs["per_round"] if r.get("compile") and r.get("llmexp")]
    done = sum(len(r) == len(figs["arms"]) for r in figs["per_round"])
    rec.lines = [
        f"{figs['model']} model ({fmt(figs['num_params'])} parameters), micro-batch {figs['micro_batch']} × "
        f"{figs['seq_len']}, bf16 autocast, AdamW, {figs['warmup']} warm-up + {figs['steps']} timed steps per arm, "
        f"{done} of {figs['rounds']} rounds complete, on {figs['device']}; bf16 matmul ceiling "
        f"{' / '.join(f'{c:.3g}' for c in figs['ceiling_tflops'])} TFLOP/s (measured first in each round); "
        f"datasheet dense bf16 peak {fmt(figs.get('datasheet_tflops'), '.0f', ' TFLOP/s')}.",
        "",
        *md_table(["arm", "tokens/s (median)", "per round", "ratio to (a), paired", "MFU", "peak GPU memory (MiB)"],
               rows),
        "",
        f"llmexp / HF Trainer, paired: {' / '.join(f'{x:.3f}×' for x in pairs) or '–'}; llmexp with compile / "
        f"without: {' / '.join(f'{x:.3f}×' for x in compile_pairs) or '–'}; compile's first step "
        f"{' / '.join(f'{c:.0f} s' for c in figs['compile_s']) or '–'} (not timed)."
        + (f" Failed arms: {'; '.join(figs['failures'])}." if figs["failures"] else ""),
    ]
    rec.verdict = (f"llmexp {statistics.median(figs['arms']['llmexp']['ratio_to_raw']):.3f}× the hand-written loop"
                   if figs["arms"].get("llmexp", {}).get("ratio_to_raw") else "no paired llmexp figure")


# ---------------------------------------------------------------- 3: the fused loss head against the model's own


def step_fused_head(ctx: Ctx) -> None:
    """The same saved Llama trained twice: once as it is (llmexp's fused head: the projection and the
    cross-entropy in chunks, no full logits), once with `logit_scale` in its config.json. Llama's modelling
    code never reads that field, so the model computes the same logits; llmexp treats it as a logit transform
    (llmexp/loss.py's LOGIT_TRANSFORMS) and runs the model's own forward and loss. That is the only switch
    the command line has; the figures are the cost of the full logits, nothing else differs."""
    p, rec = ctx.profile, ctx.record
    fused, own = ctx.dir / "model_fused", ctx.dir / "model_own"
    fields = {**p.mid_model, "vocab_size": p.head_vocab}
    made = ctx.run([PY, str(BASE_MODEL), str(fused), json.dumps(fields), "--tokenizer", str(tokenizer_dir(ctx))],
                   "base_model")
    need(made, "writing the base model")
    own.mkdir(exist_ok=True)
    for item in fused.iterdir():  # the same weights (links), another config.json
        if item.name != "config.json" and not (own / item.name).exists():
            (own / item.name).symlink_to(item)
    config = json.loads((fused / "config.json").read_text())
    (own / "config.json").write_text(json.dumps({**config, "logit_scale": 2.0}, indent=1))
    warmup, timed = p.timed
    base = [*p.mid_data, f"batch_size={p.mid_batch}", f"precision={p.precision}",
            f"train.max_steps={warmup + timed}", *RUN]  # the model's fields come from its config.json
    for arm, model in (("fused", fused), ("own", own)):
        run_dir, probe = ctx.dir / arm, ctx.dir / f"{arm}_probe.json"
        # the fused arm runs watched: its stalls a step, and a profile of one warm-up step (left out of tokens/s)
        prefix = (PY, str(PROBE), str(probe), "--profile-step", str(max(1, warmup - 1)), "--") if arm == "fused" \
            else (PY, "-m", "llmexp")
        proc = ctx.llmexp([f"model.name_or_path={model}", *base], run_dir, arm, prefix=prefix)
        need(proc, f"the {arm} arm")
        losses = [r["loss"] for r in records(run_dir, "train")]
        rec.figures[arm] = {**run_figures(run_dir, warmup), "first_loss": losses[0] if losses else None}
        if arm == "fused":
            watched = probed(probe)
            rec.figures["syncs"] = watched.get("median")
            rec.figures["attention_kernels"] = watched.get("attention_kernels")
            rec.figures["kernels"] = watched.get("kernels")
        prune(run_dir)
        rec.save()
    shutil.rmtree(own)
    shutil.rmtree(fused)  # 1.3 GB at 0.32B, in memory when the work dir is /dev/shm
    f, o = rec.figures["fused"], rec.figures["own"]
    rec.figures["speed_ratio"] = ratio(f["tokens_per_sec"], o["tokens_per_sec"])
    rec.figures["memory_ratio"] = ratio(f["peak_mem_mb"], o["peak_mem_mb"])
    rec.figures["first_loss_diff"] = abs(f["first_loss"] - o["first_loss"])
    rec.lines = [
        f"A random-init Llama ({fmt(f['total_params'])} parameters, vocabulary {p.head_vocab:,}), micro-batch "
        f"{p.mid_batch} × {p.seq_len}, precision={p.precision}, {warmup} "
        f"warm-up + {timed} timed steps, one run each, fused first.",
        "",
        *md_table(["loss path", "tokens/s", "peak memory (MiB)", "loss at step 1"],
               [["llmexp's fused head", fmt(f["tokens_per_sec"]), fmt(f["peak_mem_mb"]), fmt(f["first_loss"], ".5f")],
                ["the model's own forward and loss", fmt(o["tokens_per_sec"]), fmt(o["peak_mem_mb"]),
                 fmt(o["first_loss"], ".5f")]]),
        "",
        f"Fused / own: tokens/s {fmt(rec.figures['speed_ratio'], '.3f', '×')}, peak memory "
        f"{fmt(rec.figures['memory_ratio'], '.3f', '×')}; the step-1 losses differ by "
        f"{rec.figures['first_loss_diff']:.2e} (same weights, same batch).",
        "", sync_line(rec.figures.get("syncs"), "the fused arm"),
        "Attention in one profiled warm-up step of the fused arm (kernel, calls, ms): "
        + ("; ".join(f"`{k['name']}` {k['calls']}× {k['ms']:.2f}" for k in rec.figures.get("attention_kernels") or [])
           or "none recorded") + ".",
    ]
    rec.verdict = (f"fused head {fmt(rec.figures['speed_ratio'], '.2f', '×')} the speed at "
                   f"{fmt(rec.figures['memory_ratio'], '.2f', '×')} the memory")


def probed(path: Path) -> dict[str, Any]:
    """What benchmarks/gpu/probe.py wrote about a watched run ({} if it wrote nothing)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def sync_line(median: dict[str, Any] | None, what: str) -> str:
    """The stalls a step of a watched run (medians over its steps after the first)."""
    if not median:
        return f"Stalls a step ({what}): not recorded."
    return (f"Stalls a step ({what}; medians after step 1): {median['sync_warnings']:.0f} synchronizing CUDA "
            f"operations (`torch.cuda.set_sync_debug_mode('warn')`), {median['synchronize_calls']:.0f} "
            f"`torch.cuda.synchronize()` calls taking {1000 * median['synchronize_s']:.1f} ms.")


def tokenizer_dir(ctx: Ctx) -> Path:
    """A tokenizer of the profile's vocabulary: step 1's run saved one with its model; else a 1-step run makes one."""
    for candidate in (ctx.work / "step1" / "adamw8bit" / "model", ctx.work / "tokenizer" / "model"):
        if (candidate / "tokenizer.json").exists():
            return candidate
    run_dir = ctx.work / "tokenizer"
    need(ctx.llmexp([*ctx.profile.small, "train.max_steps=1", *RUN, "train.save_final=true", "precision=fp32"],
                    run_dir, "tokenizer"),
         "the run that makes a tokenizer")
    return run_dir / "model"


# ---------------------------------------------------------------- 4: LoRA and QLoRA (benchmarks/adapters.py)


def step_adapters(ctx: Ctx) -> None:
    """benchmarks/adapters.py: full fine-tuning, peft=lora, peft=qlora and (on a GPU) peft=lora compiled on one saved
    ~0.27B Llama (`--size mid`: a 1B's arms do not fit the time), each a fresh `python -m llmexp`; its base is kept
    for step 6's estimates."""
    rec, base = ctx.record, ctx.dir / "base"
    shutil.rmtree(base, ignore_errors=True)
    env = {**ctx.env(), "TMPDIR": str(ctx.dir)}
    proc = ctx.run([PY, "benchmarks/adapters.py", *ctx.profile.adapters, "--precision", ctx.profile.precision,
                    "--json", "--out", "", "--keep-base", str(base)], "adapters", env=env)
    facts = last_json(proc.output)
    if facts:
        rec.figures = facts
        full = facts["arms"].get("full", {})
        def with_ratio(a: dict[str, Any], key: str) -> str:
            return f"{fmt(a[key])} ({fmt(ratio(a[key], full.get(key)), '.2f', '×')})"

        rows = [[f"`{arm}`", fmt(a["trainable"]), with_ratio(a, "peak_mem_mb"),
                 with_ratio(a, "tokens_per_sec")] for arm, a in facts["arms"].items()]
        rec.lines = [f"A random-init Llama of {fmt(facts['total_params'])} parameters, "
                     f"`{' '.join(ctx.profile.adapters)} --precision {ctx.profile.precision}`; ratios to full "
                     "fine-tuning in the same run.", "",
                     *md_table(["arm", "trainable params", "peak memory (MiB)", "tokens/s"], rows)]
        if facts.get("failed"):
            rec.lines += ["", f"Failed: {', '.join(facts['failed'])} (the log has the error)."]
        rec.verdict = "; ".join(
            f"{arm} {fmt(ratio(a.get('peak_mem_mb'), full.get('peak_mem_mb')), '.2f', '×')} the memory, "
            f"{fmt(ratio(a.get('tokens_per_sec'), full.get('tokens_per_sec')), '.2f', '×')} the speed"
            for arm, a in facts["arms"].items() if arm != "full") + " of full"
        rec.save()
    need(proc, "benchmarks/adapters.py")


# ---------------------------------------------------------------- 5: FSDP2 full_shard in one process


def step_fsdp(ctx: Ctx) -> None:
    """The ~0.27B model through the plain engine and through `fsdp=full_shard` on one process (torch's launcher,
    a one-process group): the path runs, and what sharding over one process costs."""
    p, rec = ctx.profile, ctx.record
    warmup, timed = p.timed
    base = [*p.mid, f"batch_size={p.mid_batch}", f"precision={p.precision}", f"train.max_steps={warmup + timed}", *RUN]
    launcher = (PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "llmexp")
    for arm, overrides, prefix in (("plain", [], (PY, "-m", "llmexp")), ("full_shard", ["fsdp=full_shard"], launcher)):
        run_dir = ctx.dir / arm
        need(ctx.llmexp([*overrides, *base], run_dir, arm, prefix=prefix), f"the {arm} arm")
        rec.figures[arm] = {**run_figures(run_dir, warmup), "fsdp": summary(run_dir).get("fsdp")}
        prune(run_dir)
        rec.save()
    plain, shard = rec.figures["plain"], rec.figures["full_shard"]
    rec.figures["speed_ratio"] = ratio(shard["tokens_per_sec"], plain["tokens_per_sec"])
    rec.figures["memory_ratio"] = ratio(shard["peak_mem_mb"], plain["peak_mem_mb"])
    rec.lines = [f"{fmt(plain['total_params'])} parameters, micro-batch {p.mid_batch}, precision={p.precision}, "
                 f"{warmup} warm-up + {timed} timed steps, one run each.", "",
                 *md_table(["engine", "tokens/s", "peak memory (MiB)", "MFU", "final train loss"],
                        [[a, fmt(r["tokens_per_sec"]), fmt(r["peak_mem_mb"]), fmt(r["mfu"], ".1%"),
                          fmt(r["train_loss"], ".4f")] for a, r in (("plain", plain), ("fsdp=full_shard", shard))]),
                 "", f"full_shard / plain: tokens/s {fmt(rec.figures['speed_ratio'], '.3f', '×')}, peak memory "
                 f"{fmt(rec.figures['memory_ratio'], '.3f', '×')}."]
    rec.verdict = f"full_shard on one process runs at {fmt(rec.figures['speed_ratio'], '.2f', '×')} the plain engine"


# ---------------------------------------------------------------- 6: llmexp.estimate against the measured peaks


TOTAL = re.compile(r"total per device\s+([\d,.]+) MiB")
ESTIMATE_EACH = """\
import json, sys
from llmexp.cli.estimate import main
for arm, overrides in json.loads(sys.argv[1]).items():
    print(f"== estimate {arm}", flush=True)
    print(f"== exit {main(overrides)}", flush=True)
"""
"""`python -m llmexp.estimate`'s own `main` for each arm, in one process: the accounting is the same, and the
imports (~8 s a process) are paid once."""


def step_estimate(ctx: Ctx) -> None:
    """`python -m llmexp.estimate` with each step-4 arm's own overrides (one process for all), against that run's
    measured `peak_mem_mb` (torch.cuda.max_memory_allocated on a GPU; peak RSS with the libraries on a CPU). It
    needs step 4's runs of this run of the kit (their saved base, their figures)."""
    rec = ctx.record
    facts_path = ctx.work / "steps" / "4.json"
    facts = json.loads(facts_path.read_text()).get("figures", {}) if facts_path.exists() else {}
    if not facts.get("overrides"):
        raise RuntimeError("step 6 compares the estimate with step 4's runs, and step 4 left none: run step 4 first")
    rows = []
    proc = ctx.run([PY, "-c", ESTIMATE_EACH, json.dumps(facts["overrides"])], "estimate")
    need(proc, "python -m llmexp.estimate's main, for each arm")
    outputs = dict(re.findall(r"^== estimate (\S+)\n(.*?)^== exit 0$", proc.output, re.MULTILINE | re.DOTALL))
    for arm in facts["overrides"]:
        if arm not in outputs:
            raise RuntimeError(f"python -m llmexp.estimate ({arm}) did not exit 0:\n{proc.output[-2500:]}")
        match = TOTAL.search(outputs[arm])
        estimate = float(match.group(1).replace(",", "")) if match else None
        measured = facts.get("arms", {}).get(arm, {}).get("peak_mem_mb")
        error = (estimate - measured) / measured if estimate is not None and measured else None
        rec.figures[arm] = {"estimate_mb": estimate, "measured_mb": measured, "error": error}
        rows.append([arm, fmt(estimate), fmt(measured), fmt(error, "+.1%")])
        rec.save()
    cpu_note = (" On a CPU the measured peak is the process's RSS, the libraries (~450 MB) included: the error"
                " says nothing about the estimate there." if ctx.cpu else "")
    rec.lines = ["The arms of step 4, each estimated with its own overrides." + cpu_note, "",
                 *md_table(["arm", "estimate (MiB)", "measured peak (MiB)", "error of the estimate"], rows)]
    errors = [abs(r["error"]) for r in rec.figures.values() if isinstance(r, dict) and r.get("error") is not None]
    rec.verdict = f"largest error {max(errors):.0%}" if errors else "no measured peaks to compare with"


# ---------------------------------------------------------------- 7: batch_size=auto


OOM = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)


def step_auto_batch(ctx: Ctx) -> None:
    """`batch_size=auto` on the ~0.27B model: the chosen micro-batch trains (it fits), and the next candidate up (at
    most 3/2 of it) does not fit the memory budget it was chosen for (out of memory, or a peak above the budget: so
    the choice leaves at most a third of the budget unused), unless the probe already saw it fail or the candidates
    stop at the choice (the train set, the global batch, or 1024)."""
    from types import SimpleNamespace

    from llmexp.config.derived import auto_batch_candidates

    p, rec = ctx.profile, ctx.record
    base = [*p.mid, f"precision={p.precision}", *RUN]
    run_dir = ctx.dir / "auto"
    proc = ctx.llmexp(["batch_size=auto", *base, *p.auto, "train.max_steps=2"], run_dir, "auto")
    need(proc, "python -m llmexp batch_size=auto")
    start = next(iter(records(run_dir, "start")), {})
    auto = start.get("batch_size_auto") or {}
    chosen = int(auto.get("chosen", 0))
    rec.figures["auto"] = {**auto, **run_figures(run_dir, warmup=1)}
    prune(run_dir)
    rec.save()
    global_batch = next((int(o.split("=")[1]) for o in p.auto if o.startswith("train.global_batch_size=")), None)
    candidates = auto_batch_candidates(SimpleNamespace(train=SimpleNamespace(global_batch_size=global_batch)), 1,
                                       int(start.get("data_train_examples") or 0))
    bigger = [m for m in candidates if m > chosen]
    rec.figures["next"] = up = {"micro": bigger[-1] if bigger else None}
    if not bigger:
        up["fits"], up["how"] = None, f"no candidate is larger (they start at {candidates[0]})"
    elif any(e.get("micro") == up["micro"] and not e.get("fits") for e in auto.get("probed", [])):
        up["fits"], up["how"] = False, "the probe itself ran out of memory at it"
    elif ctx.cpu:
        up["fits"], up["how"] = None, "not tried: a CPU has no out-of-memory error (the kernel kills)"
    else:
        _run_next_candidate(ctx, base, up, auto.get("budget_mb"))
    fits = rec.figures["auto"]["status"] == "completed"
    holds = fits and up["fits"] is not True
    rec.lines = [f"`python -m llmexp batch_size=auto` ({fmt(rec.figures['auto'].get('total_params'))} parameters, "
                 f"precision={p.precision}): chose {chosen} (upper bound {auto.get('upper_bound')}, budget "
                 f"{fmt(auto.get('budget_mb'))} MiB, probed {auto.get('probed')}, {auto.get('search_s')} s); the run "
                 f"{rec.figures['auto']['status']} at peak {fmt(rec.figures['auto']['peak_mem_mb'])} MiB.",
                 f"The next candidate up, {up['micro']}: {up['how']}." if bigger else f"Above it: {up['how']}."]
    rec.verdict = ("holds: the choice fits and the next candidate up does not fit the budget"
                   if holds and up["fits"] is False else "the choice fits; " + up["how"] if holds else
                   "does not hold: " + ("the choice failed" if not fits else "the next candidate fits the budget too"))


def _run_next_candidate(ctx: Ctx, base: list[str], up: dict[str, Any], budget: float | None) -> None:
    """One step at the next candidate up; whether it kept within the budget. The promise is the budget (a share of
    the free memory, a margin kept), not the card: a run that completes above the budget still confirms the choice."""
    run = ctx.llmexp([f"batch_size={up['micro']}", *base, "train.max_steps=1"], ctx.dir / "next", "next")
    peak = summary(ctx.dir / "next").get("peak_mem_mb")
    up["peak_mem_mb"] = peak
    up["fits"] = run.returncode == 0 and not (peak and budget and peak > budget)
    up["how"] = "a run at it: " + (
        f"completed at peak {fmt(peak)} MiB, above the {fmt(budget)} MiB budget" if run.returncode == 0
        and not up["fits"] else f"completed at peak {fmt(peak)} MiB" if run.returncode == 0 else
        "out of memory" if OOM.search(run.output) else f"exit {run.returncode}")
    prune(ctx.dir / "next")


# ---------------------------------------------------------------- 8: kill -9 and resume


def step_kill_resume(ctx: Ctx) -> None:
    """An uninterrupted run (two on a GPU: their difference is the run-to-run noise), then the same run
    killed with SIGKILL after a checkpoint, and resumed by the same command; the losses step by step."""
    p, rec = ctx.profile, ctx.record
    max_steps, save_steps, kill_after = p.resume
    overrides = [*p.small, f"precision={p.precision if p is TINY else 'bf16'}", f"train.max_steps={max_steps}",
                 f"train.save_steps={save_steps}", "train.eval_steps=1000000", "train.logging_steps=1",
                 "train.resume=auto"]
    refs = []
    for i in range(p.reruns):
        run_dir = ctx.dir / f"reference{i}"
        shutil.rmtree(run_dir, ignore_errors=True)
        need(ctx.llmexp(overrides, run_dir, f"reference{i}"), "an uninterrupted run")
        refs.append(run_dir)
    killed = ctx.dir / "killed"
    shutil.rmtree(killed, ignore_errors=True)

    sent: list[bool] = []

    def kill_when_ready(proc: subprocess.Popen[str]) -> None:
        steps = [r["step"] for r in records(killed, "train")]
        if not sent and steps and max(steps) >= kill_after and (killed / "checkpoints" / f"step_{save_steps}").exists():
            sent.append(True)
            os.killpg(proc.pid, signal.SIGKILL)  # the whole session: no child may finish the run for it

    first = ctx.llmexp(overrides, killed, "killed", poll=kill_when_ready)
    landed_at = max((r["step"] for r in records(killed, "train")), default=0)
    resumed = ctx.llmexp(overrides, killed, "resumed")
    need(resumed, "the resumed run")
    rec.figures = compare_resume(refs, killed, first.returncode == -signal.SIGKILL, landed_at)
    for run_dir in [*refs, killed]:
        prune(run_dir)
    f = rec.figures
    rec.lines = [
        f"{max_steps} steps of the {'default tiny' if p is GPU else 'test'} model, checkpoints every {save_steps}, "
        f"precision={'bf16' if p is GPU else p.precision}. Killed (SIGKILL) after step {landed_at} (landed: "
        f"{f['kill_landed']}), resumed from step {f['resumed_from']}.",
        f"Resumed against uninterrupted, train loss step by step: {f['equal_steps']}/{f['steps']} steps bitwise equal, "
        f"largest difference {f['max_diff']:.3g}; final weights bitwise equal: {f['weights_equal']}.",
        ("Two uninterrupted runs against each other (the run-to-run noise): "
         f"{f['noise_equal_steps']}/{f['steps']} steps bitwise equal, largest difference {f['noise_max_diff']:.3g}."
         if f.get("noise_max_diff") is not None else "One uninterrupted run (the tiny path): no noise floor measured."),
    ]
    rec.verdict = f["verdict"]


def compare_resume(refs: list[Path], killed: Path, landed: bool, landed_at: int) -> dict[str, Any]:
    """Step-by-step train losses of the resumed run against the first reference (and of the references
    against each other), final weights' hashes, and what they say."""
    def losses(run_dir: Path) -> dict[int, float]:
        return {int(r["step"]): float(r["loss"]) for r in records(run_dir, "train")}  # the last record of a step

    ref, got = losses(refs[0]), losses(killed)
    steps = sorted(ref)
    diffs = [abs(got[s] - ref[s]) if s in got else math.inf for s in steps]
    resume = next(iter(records(killed, "resume")), {})
    out: dict[str, Any] = {"kill_landed": landed, "killed_after_step": landed_at, "resumed_from": resume.get("step"),
                           "steps": len(steps), "equal_steps": sum(d == 0 for d in diffs), "max_diff": max(diffs),
                           "weights_equal": weights_hash(refs[0]) == weights_hash(killed)}
    noise = None
    if len(refs) > 1:
        other = losses(refs[1])
        noise = [abs(other.get(s, math.inf) - ref[s]) for s in steps]
        out["noise_equal_steps"], out["noise_max_diff"] = sum(d == 0 for d in noise), max(noise)
    if not landed:
        out["verdict"] = "the kill did not land before the run ended: nothing was resumed"
    elif out["max_diff"] == 0 and out["weights_equal"]:
        out["verdict"] = "bitwise: the resumed run equals the uninterrupted one"
    elif noise is not None and out["max_diff"] <= 2 * max(noise):
        out["verdict"] = (f"within the run-to-run noise ({out['max_diff']:.2g} against {max(noise):.2g} between two "
                          "uninterrupted runs): nondeterministic GPU kernels (cuBLAS split-K, attention and "
                          "embedding backward atomics), not the resume")
    else:
        out["verdict"] = f"differs beyond the run-to-run noise: {out['max_diff']:.3g}"
    return out


def weights_hash(run_dir: Path) -> str | None:
    path = run_dir / "model" / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


# ---------------------------------------------------------------- main


STEPS: dict[int, tuple[str, Callable[[Ctx], None]]] = {
    1: ("The README's headline commands", step_headline),
    2: ("Throughput and MFU, ~1B Llama, bf16, sequence 2048", step_throughput),
    3: ("The fused loss head against the model's own loss", step_fused_head),
    4: ("LoRA and QLoRA against full fine-tuning", step_adapters),
    5: ("FSDP2 full_shard in one process", step_fsdp),
    6: ("llmexp.estimate against the measured peak memory", step_estimate),
    7: ("batch_size=auto", step_auto_batch),
    8: ("kill -9 and resume", step_kill_resume),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", type=int, choices=sorted(STEPS))
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--budget", type=float, required=True, help="seconds this step may take")
    parser.add_argument("--tiny", action="store_true", help="the tiny model, a few steps: the path, not the figures")
    parser.add_argument("--cpu", action="store_true", help="hide any GPU from the runs")
    parser.add_argument("--rounds", type=int, default=1, help="step 2's paired rounds")
    args = parser.parse_args(argv)
    title, run = STEPS[args.step]
    (args.work / "steps").mkdir(parents=True, exist_ok=True)
    record = Record(args.step, title, args.work / "steps" / f"{args.step}.json")
    record.save()  # an empty record: the step started

    def on_sigterm(signum: int, frame: Any) -> None:  # `timeout`'s backstop: stop the sub-run, keep the record
        raise StepTimeout("SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)
    # A few seconds of the budget are kept for the kill and the report after a sub-run is cut short.
    ctx = Ctx(args.work, TINY if args.tiny else GPU, time.time() + args.budget - 5, record, args.cpu, args.rounds)
    try:
        if str(args.step) in os.environ.get("KIT_FAIL_STEP", "").split(","):
            raise RuntimeError(f"injected failure (KIT_FAIL_STEP={os.environ['KIT_FAIL_STEP']})")
        run(ctx)
    except StepTimeout as err:
        print(f"step {args.step}: timed out: {err}", file=sys.stderr)
        return EXIT_TIMEOUT
    finally:
        record.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
