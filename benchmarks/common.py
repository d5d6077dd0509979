"""Shared helpers of the benchmark scripts: fresh-process arms, peak RSS, statistics, MFU, tables.

Every benchmark runs its variants in fresh processes, alternately, and reports ratios paired
within a round, so that a noisy (shared) machine slows every variant alike. The load average
is printed beside every table: figures taken on a loaded machine are not worth comparing with
figures taken on an idle one, but their paired ratios still are.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmexp.rundir.read import load_records

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PY = sys.executable


@dataclass
class ArmResult:
    """One fresh process: what it printed as its last JSON line, its peak RSS and wall time."""

    data: dict[str, Any]
    peak_rss_mb: float
    wall_s: float
    returncode: int
    tail: str = ""


def run_process(cmd: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 1200,
                cwd: Path = REPO, watch: Callable[[int], None] | None = None) -> ArmResult:
    """Run `cmd` in a fresh process; its peak RSS comes from wait4 (the same measure for every arm).

    The result is the last stdout line that parses as a JSON object (empty for a process that prints none).
    `watch`, if given, is called with the child's pid at every poll (every 50 ms) while it runs, e.g. to
    read its CPU time when a file it writes gains a line.
    """
    full_env = {**os.environ, "LLMEXP_NO_BAR": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=cwd, text=True)
        deadline = start + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if watch is not None:
                watch(proc.pid)
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        wall_s = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    data: dict[str, Any] = {}
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                data = json.loads(line)
                break
            except ValueError:
                continue
    return ArmResult(data, usage.ru_maxrss / 1024, wall_s, proc.returncode, text[-3000:])


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} / {five:.1f} / {fifteen:.1f} (1/5/15 min, {os.cpu_count()} cores)"


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The flags that decide a CPU's matmul speed in fp32 and bf16: every result names which the CPU has."""


def machine() -> str:
    """What a result was measured on: the GPU the runs see, else the CPU's model, its cores and its CPU_FLAGS."""
    import torch

    if torch.cuda.is_available():
        return f"GPU: {torch.cuda.get_device_name(0)}"
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    field_of = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines) if v}
    flags = set(field_of.get("flags", "").split())
    marks = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in CPU_FLAGS)
    return f"CPU: {field_of.get('model name', 'unknown')}, {os.cpu_count()} cores; {marks}"


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


@dataclass
class Series:
    """Values of one variant over the rounds."""

    values: list[float] = field(default_factory=list)

    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    def spread(self, fmt: str = "{:,.0f}") -> str:
        if not self.values:
            return "–"
        return f"{fmt.format(min(self.values))}–{fmt.format(max(self.values))}"


def rotated(items: list[str], round_index: int) -> list[str]:
    """The variants of one round, rotated so that no variant always runs first (or last)."""
    k = round_index % len(items)
    return items[k:] + items[:k]


def time_in_process(steps: dict[str, Callable[[], Any]], rounds: int, warmup: int, timed: int,
                    ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Arms that run in this process (a kernel's variants, not whole runs): each round, each arm in rotated order
    runs `warmup` then `timed` steps; its seconds a step per round, and its peak CUDA memory (none on a CPU). A
    step must wait for the device itself (read a value back) for the seconds to count its work."""
    import torch

    cuda = torch.cuda.is_available()
    seconds: dict[str, list[float]] = {arm: [] for arm in steps}
    peak_mb: dict[str, float] = {}
    for r in range(rounds):
        for arm in rotated(list(steps), r):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            for _ in range(warmup):
                steps[arm]()
            start = time.perf_counter()
            for _ in range(timed):
                steps[arm]()
            seconds[arm].append((time.perf_counter() - start) / timed)
            if cuda:
                peak_mb[arm] = torch.cuda.max_memory_allocated() / 2**20
        print(f"round {r + 1}: " + ", ".join(f"{a} {seconds[a][-1] * 1e3:.1f} ms" for a in steps), flush=True)
    return seconds, peak_mb


def paired_speed(seconds: dict[str, list[float]], arm: str, base: str) -> float:
    """`arm`'s speed over `base`'s: the median over rounds of their ratio within each round."""
    return statistics.median(b / a for b, a in zip(seconds[base], seconds[arm], strict=True))


def in_process_cells(seconds: dict[str, list[float]], peak_mb: dict[str, float], arm: str, base: str,
                     per_step: float) -> list[str]:
    """A table's cells for one arm of `time_in_process`: `per_step` units (tokens, positions) a second, the
    speed over `base` paired within rounds, the peak CUDA memory (– on a CPU)."""
    return [f"{per_step / statistics.median(seconds[arm]):,.0f}", f"{paired_speed(seconds, arm, base):.3f}×",
            f"{peak_mb[arm]:,.0f}" if arm in peak_mb else "–"]


def in_process_header(what: str, rounds: int, warmup: int, timed: int) -> str:
    """The sentence above an in-process benchmark's table: when, on what, what ran, and how it was timed."""
    import torch

    return (f"Measured {utc_now()} on {machine()}: {what}; {rounds} round(s) of {warmup} warm-up + {timed} timed "
            f"steps per arm, rotated. torch {torch.__version__}. Load average at the end: {load_average()}.")


def tiny_model_fields() -> dict[str, Any]:
    """The `tiny` model's fields, read from llmexp/conf/model/tiny.yaml so every arm builds the same model."""
    from omegaconf import OmegaConf

    fields = OmegaConf.to_container(OmegaConf.load(REPO / "llmexp" / "conf" / "model" / "tiny.yaml"))
    assert isinstance(fields, dict)
    fields.pop("name", None)
    return {str(k): v for k, v in fields.items()}


def llama_config(**overrides: Any) -> Any:
    """A LlamaConfig of the tiny model, as llmexp's build_model makes it (sdpa attention)."""
    from transformers import LlamaConfig

    fields = {**tiny_model_fields(), **overrides}
    return LlamaConfig(attn_implementation="sdpa", **fields)


def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """6N + 12 L T d: the same accounting as llmexp's `metrics.flops_per_token` (PaLM's, no causal discount)."""
    from llmexp.monitor.throughput import flops_per_token as llmexp_flops_per_token

    return llmexp_flops_per_token(num_params, num_layers, hidden_size, seq_len)


def measure_ceiling_tflops(seconds: float = 1.0, device: str = "cpu") -> float:
    """bf16 matmul ceiling (what MFU divides by): llmexp's own measurement, best of 3 windows."""
    import torch

    from llmexp.monitor.throughput import measure_ceiling

    return measure_ceiling(torch.device(device), torch.bfloat16, seconds=seconds / 3)[0]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    from llmexp.report.formats import md_table

    return "\n".join(md_table(header, rows))


def publish(text: str, out: str, directory: Path = RESULTS) -> None:
    """Print a result table; unless `out` is '', also write it to <directory>/<out> (benchmarks/results/) atomically."""
    from llmexp.rundir.files import write_text_atomic

    print(text)
    if out:
        path = directory / out
        write_text_atomic(path, text if text.endswith("\n") else text + "\n")
        print(f"\nwritten to {path}", file=sys.stderr)


def llmexp_tokens_per_sec(run_dir: Path, warmup_steps: int) -> float:
    """Tokens/s over the logged windows after warm-up: total tokens over total busy seconds.

    Each train record's `tokens_per_sec` covers the steps since the previous record, so a window's
    seconds are its tokens over its rate; windows ending at or before `warmup_steps` are dropped.
    Every step has the same token count here, so steps stand in for tokens.
    """
    records = [r for r in load_records(run_dir) if r.get("event") == "train"]
    steps = seconds = 0.0
    previous = 0
    for r in records:
        step, rate = int(r["step"]), float(r["tokens_per_sec"])
        window_steps, previous = step - previous, step
        if step <= warmup_steps or rate <= 0:
            continue
        steps += window_steps
        seconds += window_steps / rate  # a weighted harmonic mean of the windows' rates
    return steps / seconds if seconds else 0.0
