"""Throughput, MFU and memory: FLOPs per token, the matmul ceiling MFU divides by, the tokens/s window and
MFU of each logged step, peak memory and RSS."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from llmexp.machine.precision import cpu_has_fast_bf16
from llmexp.rundir.readers import Damaged, load_json, reader


def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int,
                    trainable: int | None = None) -> float:
    """Training FLOPs per token: 6N for the weights plus the attention scores and values; a frozen weight (LoRA's
    base) 4N: its forward and the gradient it passes on, no gradient of its own. `trainable`: None, all of them.

    Attention adds 2 (QK^T and AV) x 2 (mul+add) x 3 (fwd+bwd) x layers x seq x hidden = 12 L T d
    (the PaLM paper's accounting, no causal discount).
    """
    trained = num_params if trainable is None else trainable
    return 4.0 * num_params + 2.0 * trained + 12.0 * num_layers * seq_len * hidden_size


DATASHEET_TFLOPS: tuple[tuple[str, str, float], ...] = (
    (r"H200", "H200", 989.0), (r"H100.*PCIe", "H100 PCIe", 756.0), (r"H100.*(SXM|HBM3)", "H100 SXM", 989.0),
    (r"A100", "A100", 312.0), (r"L40S", "L40S", 362.0), (r"\bL4\b", "L4", 121.0), (r"\bA10\b", "A10", 125.0),
    (r"RTX 4090", "RTX 4090", 165.0))
"""(pattern of `torch.cuda.get_device_name`, card, dense bf16/fp16 tensor-core TFLOP/s of its datasheet): the peak
torchtitan and llm-foundry divide by, so that an MFU compares across frameworks. A card not listed (H100 NVL, A10G,
...) gets the measured ceiling."""


def datasheet_peak(device_name: str, dtype: torch.dtype | None) -> tuple[str, float] | None:
    """(card, dense TFLOP/s) for a known GPU training in bf16 or fp16; None otherwise (fp32, a CPU, an unknown card)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    return next(((card, tflops) for pattern, card, tflops in DATASHEET_TFLOPS if re.search(pattern, device_name)),
                None)


def mfu_peak(device: torch.device, dtype: torch.dtype | None, measured: float | None
             ) -> tuple[float | None, dict[str, object]]:
    """(the peak MFU divides by, the `start` record's facts on it): a known GPU's datasheet peak in bf16/fp16, with the
    measured ceiling beside it as `measured_tflops`; elsewhere (a CPU, fp32, an unknown card) the measured ceiling,
    named so."""
    sheet = datasheet_peak(torch.cuda.get_device_name(device) if device.type == "cuda" else device.type, dtype)
    if sheet is None:
        return measured, {"peak_tflops_source": "measured matmul ceiling", "measured_tflops": measured}
    return sheet[1], {"peak_tflops_source": f"datasheet: {sheet[0]}, dense", "measured_tflops": measured}


def probe_size(device: torch.device, dtype: torch.dtype) -> int:
    """The side of the square matmuls that measure the ceiling: large enough that every thread works. A GPU needs
    ~1 TFLOP per matmul to hide launch overhead. On a CPU, oneDNN's AMX bf16 kernel runs 1024x1024 on one thread
    (1.60 TFLOPS, half the cores' CPU time) and 2048x2048 on all of them (2.56 TFLOPS; 2-core Xeon with AMX).
    Without native bf16 (and in fp16) a CPU's 16-bit matmul is slow enough (~1 s at 1024) to keep every thread
    busy at 1024 already, and 2048 would take 8x as long."""
    if device.type == "cuda":
        return 8192
    return 2048 if dtype == torch.bfloat16 and cpu_has_fast_bf16() else 1024


def measure_peak_tflops(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """A matmul ceiling for MFU, measured here: large square matmuls in the training dtype."""
    n = probe_size(device, dtype)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    warm_up = time.perf_counter()
    a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the warm-up (and cuBLAS set-up) stays out of the window
    one_s = time.perf_counter() - warm_up
    if one_s >= seconds:  # a slow dtype here (fp16 on a CPU: ~1 s a matmul): one matmul is the whole window
        return 2.0 * n**3 / one_s / 1e12
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2.0 * n**3 * count / (time.perf_counter() - start) / 1e12


def measure_ceiling(device: torch.device, dtype: torch.dtype, seconds: float = 0.1) -> tuple[float, bool]:
    """(the best of three matmul ceilings, whether this process had its cores to itself).

    On CPU, cores shared with other processes show as CPU time below threads x wall time while the
    matmuls run (~0.97 alone here, ~0.5-0.6 beside one or two busy processes). The load average
    cannot tell: it lags by a minute. A ceiling measured on shared cores is too low, and every MFU
    divided by it too high, so it must not be kept.
    """
    wall, cpu = time.perf_counter(), time.process_time()
    best = max(measure_peak_tflops(device, dtype, seconds) for _ in range(3))
    if device.type != "cpu":
        return best, True
    share = (time.process_time() - cpu) / (torch.get_num_threads() * (time.perf_counter() - wall))
    return best, share >= 0.85


@dataclass
class ThroughputWindow:
    """Tokens and busy seconds since the last log (eval and checkpoint time excluded), and in all; the loop's."""

    tokens: int = 0
    seconds: float = 0.0
    total_tokens: int = 0
    total_seconds: float = 0.0
    compile_s: dict[str, float] = field(default_factory=dict)
    """Under train.compile, the seconds of the first train step and of the first eval, by graph (`train`, `eval`):
    each compiles its own graph (the eval one runs without grad), and the train step's is kept out of the
    throughput."""
    _start: float = field(default_factory=time.perf_counter)

    def begin(self) -> None:
        self._start = time.perf_counter()

    def add(self, tokens: int) -> None:
        elapsed = time.perf_counter() - self._start
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + elapsed
        self.total_tokens, self.total_seconds = self.total_tokens + tokens, self.total_seconds + elapsed

    def set_aside_compile(self, graph: str) -> None:
        """What was timed since `begin` (the first train step, or the first eval) compiled `graph`: its seconds are
        `compile_s[graph]`, not throughput."""
        self.compile_s[graph] = time.perf_counter() - self._start

    def take(self) -> float:
        """Tokens per second since the last `take`."""
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        self.tokens, self.seconds = 0, 0.0
        return rate

    def overall(self) -> float:
        """Tokens per second over the whole run."""
        return self.total_tokens / self.total_seconds if self.total_seconds else 0.0


class Mfu:
    """Model FLOPs utilisation in [0, 1] of a tokens/s figure, or None when the ceiling is not trusted.

    A value above `plausible` (on a CPU, `CPU_MFU_PLAUSIBLE`) measures the ceiling again, once (`remeasure`); why and
    what follows: docs/explanation/performance.md ("The default run, throughput and start-up"). Owned by whoever
    logs (the loop's train records and the summary); the ceiling it starts from is the run description's."""

    def __init__(self, flops_per_token: float, peak_tflops: float | None, world: int, plausible: float = 1.0,
                 remeasure: Callable[[], float | None] | None = None) -> None:
        self.flops_per_token, self.peak_tflops, self.world = flops_per_token, peak_tflops, world
        self.plausible, self._remeasure = plausible, remeasure
        self.note: str | None = None
        """Why MFU stopped being reported, once it did."""
        self._note_pending = False

    def __call__(self, tokens_per_sec: float) -> float | None:
        if self.peak_tflops is None or self.peak_tflops <= 0:
            return None
        value = self._value(tokens_per_sec)
        if value > self.plausible and self._remeasure is not None:
            fresh, self._remeasure = self._remeasure(), None  # once a run: ~0.3 s of matmuls
            if fresh is not None and fresh > self.peak_tflops:
                self.peak_tflops = fresh
                value = self._value(tokens_per_sec)
        if value > 1.0:
            self.note = (f"MFU came out at {value:.0%}, above 100%: the matmul ceiling ({self.peak_tflops:.3g} "
                         "TFLOPS) is too low, and measuring it again did not help (busy cores); run once on an "
                         "idle machine, or set train.peak_tflops")
            self.peak_tflops, self._note_pending = None, True
            return None
        return value

    def _value(self, tokens_per_sec: float) -> float:
        assert self.peak_tflops is not None
        return self.flops_per_token * tokens_per_sec / (self.peak_tflops * 1e12 * self.world)

    def take_note(self) -> str | None:
        """The reason MFU stopped, on the first record after it did; None otherwise."""
        note, self._note_pending = (self.note if self._note_pending else None), False
        return note


@reader
def load_ceilings(path: Path) -> dict[str, float]:
    """The matmul ceilings cached in `path` (`peak_tflops.json` in data.cache_dir: key -> TFLOP/s). A cache: a
    file that is not an object of positive finite numbers is a miss, measured again, never a crash or a negative
    MFU."""
    data = load_json(path, load_ceilings)  # (finite numbers: a cache's fields are checked so)
    if bad := [k for k, v in data.items() if v <= 0]:
        raise Damaged(path, f"{bad[0]}: {data[bad[0]]!r} is not a positive number of TFLOP/s")
    return {k: float(v) for k, v in data.items()}


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory: max allocated on CUDA, peak RSS of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def reset_peak_rss() -> None:
    """Make the peak RSS this process's current RSS (Linux >= 4.0: `/proc/self/clear_refs`), so that the next
    `peak_rss_mb` is the peak of what ran since: an earlier, higher one (imports, memory the allocator has since
    returned) would otherwise count."""
    # Not Linux: peak_rss_mb is then the whole process's peak (an overestimate at worst).
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mb() -> float:
    """The peak RSS since `reset_peak_rss` (Linux: VmHWM), else the whole process's."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def process_age_s() -> float:
    """Seconds since this process started: its imports included, which no timer inside it can see. On Linux from the
    kernel's start tick and the boot clock (to 10 ms): psutil's create_time adds the boot time in whole seconds
    (/proc/stat's btime), so an age from it can read up to 1 s long (0.9 s on a 2-core Intel Xeon with AVX-512)."""
    try:
        with open("/proc/self/stat") as f:  # field 22, starttime: the fields after the command's closing ")"
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        return time.time() - psutil.Process().create_time()


def rss_mb() -> float:
    """This process's resident memory now."""
    return psutil.Process().memory_info().rss / 2**20
