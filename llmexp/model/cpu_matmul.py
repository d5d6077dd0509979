"""fp32 matmuls through oneDNN on CPUs where torch's default BLAS is slower; a start-up probe decides.
See docs/how-to/precision.md and docs/explanation/performance.md.

Why: torch's x86 wheel sends fp32 `mm` / `linear` to MKL's sgemm, which takes a narrower kernel on AMD CPUs even
with AVX-512 (Zen 4/5). Measured on a Zen 5 EPYC core on every shape of a 135M Llama's step: MKL 85-108 GFLOP/s,
oneDNN 170-240, results equal to ~1e-6 relative (summation order). On Intel (AVX-512) oneDNN ran 0.92-0.96x.

Why a private op: torch's public API cannot run a *trainable fp32* linear through oneDNN (`torch.backends.mkldnn`
does it only at reduced precision, bf32/tf32; `MKL_ENABLE_INSTRUCTIONS` can only lower MKL's choice;
`torch.utils.mkldnn.to_mkldnn` is inference-only). `torch.ops.mkldnn._linear_pointwise`, which inductor emits for
CPU linears, takes dense and strided fp32 tensors; this module is the one place that calls it. Used only where
`route` is called (CPU, fp32, eager, plain engine) and `probe` found it faster and equal on the model's shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from llmexp.data.cache import save_cache
from llmexp.errors import first_line
from llmexp.rundir.readers import Damaged, load_json, reader

MIN_SPEEDUP = 1.15
"""oneDNN is taken only when its best time beats torch's by this much: below it the gain is within the probe's
noise on a shared machine, and not worth a private op."""
MAX_REL_DIFF = 1e-5
"""The largest |oneDNN - torch| / max|torch| the probe accepts (fp32 summation order gives ~1e-6)."""
PROBE_ROUNDS = 5
PROBE_MAX_ROWS = 1024


def _op() -> Any | None:
    """The private op, or None where this torch build lacks it (or oneDNN)."""
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def mm_t(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b.T (+ bias) through oneDNN: 2-D fp32 CPU tensors, either of them possibly a transposed view."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


def torch_mm_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T through torch's own path (MKL on x86 wheels): the fallback, and the probe's reference."""
    return a @ b.t()


class _Linear(torch.autograd.Function):
    """y = x @ W.T + b with every matmul of forward and backward through oneDNN."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.in_shape, ctx.has_bias = x.shape, bias is not None
        return mm_t(x2, weight, bias).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = mm_t(dy2, weight.t()).reshape(ctx.in_shape) if ctx.needs_input_grad[0] else None
        dw = mm_t(dy2.t(), x2.t()) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Checked at every call, so a routed model stays right wherever it runs later (moved to a GPU, autocast
    opened around it, compiled): only fp32 on CPU, eager."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.dim() >= 2 and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through oneDNN where `applies`."""
    return _Linear.apply(x, weight, bias) if applies(x, weight) else F.linear(x, weight, bias)


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def route(model: nn.Module) -> int:
    """Send every plain nn.Linear of `model` (peft's base layers and adapters included) through oneDNN; returns
    how many. The forward is replaced on each instance, so parameters, state_dict, saving and peft's merging are
    untouched; subclasses (bitsandbytes' 4-bit layers, peft's wrappers) keep their own forward."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = _linear_forward.__get__(module)  # a bound method on the instance
            n += 1
    return n


@dataclass(frozen=True)
class MatmulPath:
    """How this run's fp32 CPU matmuls go, and why (the `start` record's `cpu_matmul`)."""

    path: str
    """onednn or torch."""
    reason: str
    speedup: float | None = None
    """torch's best time / oneDNN's on the probed shape."""
    max_rel_diff: float | None = None

    @property
    def onednn(self) -> bool:
        return self.path == "onednn"

    def record(self) -> dict[str, Any]:
        return asdict(self)

    def matmul_t(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return mm_t if self.onednn else torch_mm_t


def probe(rows: int, in_features: int, out_features: int) -> MatmulPath:
    """Time torch's and oneDNN's `x @ W.T` on the model's own shape (`fastest_calls`, `PROBE_ROUNDS` rounds), and
    check that forward, d input and d weight agree."""
    if _op() is None:
        return MatmulPath("torch", f"torch.ops.mkldnn._linear_pointwise is not in torch {torch.__version__}")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(min(rows, PROBE_MAX_ROWS), in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5
    dy = torch.randn(x.shape[0], out_features, generator=gen)
    pairs = ((x, w), (dy, w.t()), (dy.t(), x.t()))  # forward, d input, d weight: the strided views backward uses
    try:
        diff = max(_rel_diff(mm_t(a, b), torch_mm_t(a, b)) for a, b in pairs)
    except RuntimeError as err:  # the op exists but refuses these tensors (another oneDNN build)
        return MatmulPath("torch", f"oneDNN's linear failed on this CPU ({first_line(err, 120)})")
    if not diff <= MAX_REL_DIFF:
        return MatmulPath("torch", f"oneDNN's result differs from torch's by {diff:.1e} (relative)", None, diff)
    best = fastest_calls({"torch": lambda: torch_mm_t(x, w), "onednn": lambda: mm_t(x, w)},
                         lambda rounds: rounds < PROBE_ROUNDS)
    speedup = best["torch"] / max(best["onednn"], 1e-9)
    shape = f"a {x.shape[0]} x {in_features} x {out_features} matmul"
    if speedup < MIN_SPEEDUP:
        return MatmulPath("torch", f"oneDNN ran {shape} at {speedup:.2f}x torch's speed here; taken from "
                          f"{MIN_SPEEDUP}x", round(speedup, 2), diff)
    return MatmulPath("onednn", f"{speedup:.2f}x torch's speed on {shape} here, same results to {diff:.0e}",
                      round(speedup, 2), diff)


def fastest_calls(arms: dict[str, Callable[[], Any]], more: Callable[[int], bool]) -> dict[str, float]:
    """Each arm's shortest call, over rounds that alternate the arms (one, then more while `more(rounds run)`), after
    one warm-up call each (first-call allocations, MKL and oneDNN set-up). On one thread, timed in this thread's CPU
    seconds: the kernels' speed per core, which neither other processes on the cores nor OpenMP's waits for a
    descheduled thread distort (on a loaded 2-core machine wall-clock ratios came out 20x)."""
    best = dict.fromkeys(arms, float("inf"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for fn in arms.values():
            fn()
        rounds = 0
        while rounds == 0 or more(rounds):
            for name, fn in arms.items():
                began = time.thread_time()
                fn()
                best[name] = min(best[name], time.thread_time() - began)
            rounds += 1
    finally:
        torch.set_num_threads(threads)
    return best


def probe_once(cache: Path, rows: int, in_features: int, out_features: int) -> MatmulPath:
    """`probe`'s verdict, measured once per machine, shape and thread count and kept in `cache` (a JSON object in
    data.cache_dir): a timing near `MIN_SPEEDUP` would otherwise flip between runs, and with it the last bits of
    every loss (a resumed run, or an lr=find run against a plain one, would not be bitwise the same). A damaged
    cache is a miss: probed again."""
    key = f"{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}|{min(rows, PROBE_MAX_ROWS)}x" \
          f"{in_features}x{out_features}|{torch.get_num_threads()} thread(s)"
    known = read_verdicts(cache) or {}
    if key in known:
        return known[key]
    path = probe(rows, in_features, out_features)
    if path.speedup is not None:  # measured (not "the op is missing"): the same verdict for every later run
        save_cache(cache, {**{k: v.record() for k, v in known.items()}, key: path.record()},
                   "the matmul path is probed again")
    return path


@reader
def read_verdicts(cache: Path) -> dict[str, MatmulPath]:
    """The verdicts kept in `cache`; a cache: anything but a probe's verdicts is a miss, probed again."""
    data = load_json(cache, read_verdicts)
    if bad := [k for k, v in data.items() if v["path"] not in ("onednn", "torch") or len(v) != 4]:
        raise Damaged(cache, f"{bad[0]} is {data[bad[0]]!r:.200}, not a probe's verdict")
    return {k: MatmulPath(**v) for k, v in data.items()}


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def widest_linear(model: nn.Module, skip: nn.Module | None = None) -> tuple[int, int] | None:
    """(in, out) features of the largest plain nn.Linear other than `skip` (the output head): the shape to probe."""
    shapes = [(m.in_features, m.out_features) for m in model.modules() if type(m) is nn.Linear and m is not skip]
    return max(shapes, key=lambda s: s[0] * s[1]) if shapes else None
