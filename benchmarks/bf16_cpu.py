"""bf16 on a CPU: step time of fp32, torch's bf16 autocast and llmexp's emulated bf16, paired in one run.

    python benchmarks/bf16_cpu.py                 # natively: 2 rounds, 1 warm-up + 3 timed steps an arm
    python benchmarks/bf16_cpu.py --avx2          # also under the AVX2-only reproduction (slow: bf16 there)
    python benchmarks/bf16_cpu.py --quick --out ''

Each arm is a fresh process that trains the tiny model (llmexp/conf/model/tiny.yaml, micro-batch 4 x 256,
AdamW, llmexp's fused loss head) and times a 512x512 matmul in fp32, bf16 and emulated bf16 (GFLOP/s, best of
a few windows), and runs llmexp's start-up probe. Arms run in a rotated order each round; ratios are to the
fp32 arm of the same round and environment.

The AVX2 reproduction (`--avx2`) sets, before torch is imported: ATEN_CPU_CAPABILITY=avx2 (ATen's own kernels),
ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN then reports no bf16 support, so torch's bf16 gemms fall back to ATen's
reference gemm, the path of a CPU without AVX512) and MKL_ENABLE_INSTRUCTIONS=AVX2 (fp32 sgemm). Writes
benchmarks/results/bf16_cpu.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, Series, load_average, machine, markdown_table, publish, rotated, run_process, utc_now

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
ARMS = ("fp32", "bf16", "emulated")
BATCH, SEQ = 4, 256


# ------------------------------------------------------------------------------------------------ worker (one arm)
@contextlib.contextmanager
def precision(arm: str) -> Iterator[None]:
    import torch

    from llmexp.model.bf16_emulation import Bf16Emulation

    if arm == "fp32":
        yield
        return
    with torch.autocast("cpu", torch.bfloat16), Bf16Emulation() if arm == "emulated" else contextlib.nullcontext():
        yield


def step_times(arm: str, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """(wall seconds, process CPU seconds) of each timed training step (forward, backward, AdamW) of the tiny model.

    CPU seconds are the robust figure on shared cores with one thread: they count the work, not the waiting."""
    import torch
    from common import llama_config
    from transformers import LlamaForCausalLM

    from llmexp.model.loss import CausalLMLoss

    torch.manual_seed(0)
    model = CausalLMLoss(LlamaForCausalLM(llama_config()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ids = torch.randint(0, model.lm.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    wall, cpu = [], []
    for step in range(warmup + steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        with precision(arm):  # forward and backward inside, as the trainer must wire it
            loss = model(input_ids=ids, labels=ids) / ids.numel()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= warmup:
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return wall, cpu


def matmul_gflops(arm: str, size: int = 512, calls: int = 3) -> float:
    """GFLOP/s of a size x size matmul in this arm's precision on one thread: its best call in thread CPU seconds
    (the work, whatever else holds the cores), after a warm-up."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    if arm != "fp32":
        a, b = a.bfloat16(), b.bfloat16()

    def call() -> Any:
        with precision("emulated" if arm == "emulated" else "fp32"):
            return a @ b

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        call()
        return 2 * size**3 / min(_cpu_seconds(call) for _ in range(calls)) / 1e9
    finally:
        torch.set_num_threads(threads)


def _cpu_seconds(fn: Callable[[], Any]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def worker(arm: str, warmup: int, steps: int, threads: int) -> dict[str, Any]:
    import torch

    from llmexp.model.bf16_emulation import probe_bf16_slowdown

    torch.set_num_threads(threads)
    probe = probe_bf16_slowdown()
    wall, cpu = step_times(arm, warmup, steps)
    return {"arm": arm, "step_s": min(wall), "step_cpu_s": min(cpu), "steps": wall, "gflops": matmul_gflops(arm),
            "probe": {"native": probe.native_slowdown, "emulated": probe.emulated_slowdown, "seconds": probe.seconds},
            "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "torch": torch.__version__}


# ------------------------------------------------------------------------------------------------ the paired run


def run_arm(env_name: str, arm: str, threads: int, warmup: int, steps: int) -> dict[str, Any]:
    env = {**(AVX2_ENV if env_name == "avx2" else {}), "OMP_NUM_THREADS": str(threads)}
    res = run_process([PY, __file__, "--worker", arm, "--warmup", str(warmup), "--steps", str(steps), "--threads",
                       str(threads)], env=env, timeout_s=3600)
    if res.returncode != 0 or not res.data:
        print(f"{env_name}/{arm} failed (exit {res.returncode}):\n{res.tail}", file=sys.stderr)
    return res.data


Cell = tuple[str, int, str]
"""(environment, threads, arm)."""


def collect(envs: list[str], threads: list[int], rounds: int, warmup: int, steps: int,
            slow_steps: int) -> dict[str, Any]:
    """Every (environment, threads, arm) once a round, rotated; ratios paired with the round's fp32 arm of the same
    environment and threads. Step figures are each run's fastest timed step (the least disturbed by other work)."""
    cells: list[Cell] = [(e, t, a) for e in envs for t in threads for a in ARMS]
    series = {kind: {c: Series() for c in cells} for kind in ("wall", "cpu", "wall_ratio", "cpu_ratio", "gflops")}
    probes: dict[tuple[str, int], list[dict[str, float]]] = {(e, t): [] for e in envs for t in threads}
    capability: dict[str, str] = {}
    torch_version = "?"
    loads = [load_average()]
    for r in range(rounds):
        results: dict[Cell, dict[str, Any]] = {}
        for cell in rotated(cells, r):
            env_name, n_threads, arm = cell
            n = slow_steps if (env_name, arm) == ("avx2", "bf16") else steps  # ~10-40x slower: fewer steps
            data = run_arm(env_name, arm, n_threads, warmup, n)
            if not data:
                continue
            results[cell] = data
            series["wall"][cell].values.append(data["step_s"])
            series["cpu"][cell].values.append(data["step_cpu_s"])
            series["gflops"][cell].values.append(data["gflops"])
            probes[env_name, n_threads].append(data["probe"])
            capability[env_name], torch_version = data["capability"], data["torch"]
            print(f"round {r + 1}: {env_name:6s} {n_threads} thr {arm:8s} step {data['step_s']:7.3f} s wall "
                  f"{data['step_cpu_s']:7.3f} s CPU  matmul {data['gflops']:7.1f} GFLOP/s  [{load_average()}]",
                  file=sys.stderr, flush=True)
        for (env_name, n_threads, arm), data in results.items():
            if (base := results.get((env_name, n_threads, "fp32"))) is not None:
                series["wall_ratio"][env_name, n_threads, arm].values.append(data["step_s"] / base["step_s"])
                series["cpu_ratio"][env_name, n_threads, arm].values.append(data["step_cpu_s"] / base["step_cpu_s"])
        loads.append(load_average())
    return {**series, "probes": probes, "capability": capability, "loads": loads, "cells": cells,
            "torch": torch_version}


def report(facts: dict[str, Any], args: argparse.Namespace) -> str:
    rows = []
    for cell in facts["cells"]:
        env_name, n_threads, arm = cell
        g, g_fp32 = facts["gflops"][cell].median(), facts["gflops"][env_name, n_threads, "fp32"].median()
        wall, cpu = facts["wall"][cell], facts["cpu"][cell]
        rows.append([f"{env_name} ({facts['capability'].get(env_name, '?')})", str(n_threads), arm,
                     f"{wall.median():.3f}", f"{facts['wall_ratio'][cell].median():.2f}×",
                     f"{cpu.median():.3f}", f"{facts['cpu_ratio'][cell].median():.2f}× "
                     f"({facts['cpu_ratio'][cell].spread('{:.2f}')})", f"{BATCH * SEQ / wall.median():,.0f}",
                     f"{g:.1f}", f"{g_fp32 / g:.1f}×" if g else "–"])
    table = markdown_table(["environment", "threads", "arm", "step, s wall", "wall vs fp32", "step, s CPU",
                            "CPU vs fp32 (spread)", "tokens/s", "512² matmul GFLOP/s, 1 thread", "matmul vs fp32"],
                           rows)
    probe_lines = []
    for (env_name, n_threads), probes in facts["probes"].items():
        if probes:
            native = statistics.median(p["native"] for p in probes)
            emulated = statistics.median(p["emulated"] for p in probes)
            seconds = max(p["seconds"] for p in probes)
            probe_lines.append(f"- {env_name}, {n_threads} thread(s): torch's bf16 matmul {native:.2f}× fp32's, "
                               f"emulated {emulated:.2f}× (median of {len(probes)} probes; the longest took "
                               f"{seconds:.2f} s)")
    busy = max(float(load.split(" / ")[0]) for load in facts["loads"]) > (os.cpu_count() or 1)
    caveat = (" **The cores were oversubscribed during this run (1-minute load above the core count): wall times "
              "and multi-thread CPU times (which count spinning at barriers) are distorted; the 1-thread CPU "
              "columns are the figures to use.**" if busy else "")
    return (f"Measured {utc_now()} on {machine()}, torch {facts.get('torch', '')}; {args.rounds} round(s), "
            f"{args.warmup} warm-up + {args.steps} timed steps an arm ({args.slow_steps} for bf16 under the AVX2 "
            f"reproduction); tiny model, micro-batch {BATCH} x {SEQ}, AdamW, fused loss head. `avx2` is the "
            f"reproduction of an AVX2-only CPU: {', '.join(f'{k}={v}' for k, v in AVX2_ENV.items())}, set before "
            "torch is imported. Step figures: each run's fastest timed step, median over rounds; ratios paired "
            "within a round. With 1 thread the CPU seconds count the work whatever else runs on the cores; with "
            "more, wall seconds are what a user waits (and what busy cores distort most).\n\n"
            f"Load average before and after each round: {'; '.join(facts['loads'])}.{caveat}\n\n{table}\n\n"
            "`bf16` is torch's `torch.autocast('cpu', torch.bfloat16)`; `emulated` is the same autocast with "
            "`llmexp.model.bf16_emulation.Bf16Emulation` around forward and backward (bf16 gemms and attention run "
            "in fp32 on their bf16 operands, results rounded to bf16).\n\nStart-up probe "
            "(`probe_bf16_slowdown`: 256² matmuls on one thread, best of alternating calls in thread CPU "
            "time):\n" + "\n".join(probe_lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--slow-steps", type=int, default=1, help="timed steps of torch's bf16 under --avx2")
    parser.add_argument("--avx2", action="store_true", help="also run every arm under the AVX2-only reproduction")
    parser.add_argument("--avx2-only", action="store_true", help="only the AVX2-only reproduction")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts to run each arm with")
    parser.add_argument("--quick", action="store_true", help="1 round, 1 timed step: checks the script runs")
    parser.add_argument("--out", default="bf16_cpu.md", help="file name under benchmarks/results/ ('' skips)")
    parser.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.warmup, args.steps, int(args.threads))), flush=True)
        return
    if args.quick:
        args.rounds, args.steps, args.slow_steps = 1, 1, 1
    envs = ["avx2"] if args.avx2_only else ["native", "avx2"] if args.avx2 else ["native"]
    threads = [int(t) for t in args.threads.split(",") if t]
    facts = collect(envs, threads, args.rounds, args.warmup, args.steps, args.slow_steps)
    publish(report(facts, args), args.out)


if __name__ == "__main__":
    main()
