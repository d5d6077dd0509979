"""bf16 numerics at fp32 speed on CPUs without native bf16 (no AVX512-BF16 or AMX); see docs/how-to/precision.md.

Why: there oneDNN refuses bf16 (`ideep::has_bf16_type_support`), so every bf16 gemm falls back to ATen's
one-thread reference gemm (`cpublas::gemm`): ~1-3 GFLOP/s a core against ~100 for MKL's sgemm; a bf16 autocast
step of the tiny model costs 12.7x fp32's per core (benchmarks/bf16_cpu.py, AVX2 reproduction). Emulated: 1.1x.

`Bf16Emulation` runs *inside* `torch.autocast("cpu", torch.bfloat16)`, which still decides every dtype; it only
swaps the kernel of each bf16 gemm-type aten op: operands widened to fp32 (exact), MKL's sgemm, the result rounded
once to bf16, as a bf16 gemm does (only the accumulation order differs).

Why a dispatch mode (below autograd), not a function mode: it also sees backward's aten ops and the Python ones
run during backward (checkpoint recomputation, bitsandbytes' 4-bit backward) when backward runs inside it; a
function mode is disabled while it handles a call, so it sees neither.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import torch

# PyTorch documents dispatch modes ("Extending PyTorch": __torch_dispatch__) with these two as their home: there is
# no public alias. Both have kept their API since torch 2.0.
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from llmexp.machine.precision import Precision
from llmexp.model.cpu_matmul import fastest_calls

aten = torch.ops.aten

EMULATION_ENV = "LLMEXP_BF16_EMULATION"
"""`1` forces the emulation on (e.g. to test it on a CPU with native bf16), `0` off; unset: `use_bf16_emulation`."""

_GEMMS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "_addmm_activation",
          "addmm_", "baddbmm_", "addbmm_", "addmv_")
"""aten ops whose bf16 CPU kernel is a gemm (`linear` and `matmul` decompose into these before the mode sees them)."""
_ATTENTION_FWD = aten._scaled_dot_product_flash_attention_for_cpu
"""SDPA's CPU kernel: its bf16 form runs both of its matmuls on the same slow gemm. Returns (out, logsumexp)."""
_ATTENTION_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward


def _emulable(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """True when the op would run a bf16 CPU kernel: some operand is bf16, none fp16/fp64 (left to torch), and its
    positional tensors on the CPU. fp32 beside bf16 is allowed: the attention backward takes an fp32 logsumexp."""
    tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    return any(t.dtype == torch.bfloat16 for t in tensors) and all(
        t.dtype in (torch.bfloat16, torch.float32) for t in tensors) and all(
        a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))


Widen = Callable[[Any], Any]


def _gemm(func: Any, args: Sequence[Any], kwargs: dict[str, Any], widen: Widen) -> Any:
    """A gemm on bf16 operands: fp32 kernel on their exact fp32 values, result rounded to bf16 once; an out= or an
    in-place one (`addmm_(self, ...)` and friends) runs the functional gemm and copies it into `out` or `self`."""
    kwargs = dict(kwargs)
    name = func.overloadpacket.__name__
    out = args[0] if name.endswith("_") else kwargs.pop("out", None)
    functional = getattr(aten, name.rstrip("_")).default if out is not None else func
    result = functional(*tree_map(widen, tuple(args)), **tree_map(widen, kwargs)).to(torch.bfloat16)
    return result if out is None else out.copy_(result)


class _WideCache:
    """bf16 operands widened to fp32 (exact: the fp32 kernel sees the very values the bf16 kernel would), the last
    few copies kept so that a shared operand is widened once: dY in a linear's two backward gemms (dX = dY @ W,
    dW = dY^T @ X), the softmax gradient in the fused head's two (measured on the tiny model: a third of the
    elements widened in a step). An entry holds its bf16 source, so no other tensor can take that memory while it
    is cached, and the version counter in the key catches in-place changes."""

    ENTRIES = 4
    MAX_BYTES = 1 << 29
    """Bounds what the cache keeps alive beyond a gemm: 4 copies, 512 MiB in all."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def widen(self, x: Any) -> Any:
        if not (isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16):
            return x
        if x.is_inference() or x.dim() > 4:  # inference tensors have no version counter
            return x.float()
        key = _storage_key(x, x.shape, x.stride())
        if (hit := self._entries.get(key)) is not None:
            self._entries.move_to_end(key)
            return hit[1]
        if x.dim() == 2 and (hit := self._entries.get(_storage_key(x, x.shape[::-1], x.stride()[::-1]))) is not None:
            return hit[1].t()  # the widened transpose, transposed back: the same values in the same memory layout
        wide = x.float()
        self._entries[key] = (x, wide)
        while len(self._entries) > self.ENTRIES or sum(w.nbytes for _, w in self._entries.values()) > self.MAX_BYTES:
            self._entries.popitem(last=False)
        return wide


def _storage_key(x: torch.Tensor, shape: Sequence[int], stride: Sequence[int]) -> tuple[Any, ...]:
    return (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(shape), tuple(stride), x._version)


ATTENTION_CHUNK_VALUES = 1 << 22
"""Attention scores materialised at once (fp32): 16 MB, however long the sequence."""


@dataclass(frozen=True)
class _Attention:
    """One bf16 attention call as the CPU flash kernel takes it: q, k, v widened to fp32 (exact) as (batch * heads,
    sequence, head size) for bmm, the mask made additive, the scale resolved."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    is_causal: bool
    scale: float
    heads: tuple[int, int]
    """(batch, heads) of q."""

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: Sequence[Any], kwargs: dict[str, Any],
           dropout_at: int) -> _Attention | None:
        """The call's attention; None with dropout (at `args[dropout_at]`, `is_causal` after it), which the flash
        kernel does not have: never reached through SDPA, left to torch."""
        if _arg(args, kwargs, dropout_at, "dropout_p", 0.0):
            return None
        is_causal = _arg(args, kwargs, dropout_at + 1, "is_causal", False)
        mask, scale = kwargs.get("attn_mask"), kwargs.get("scale")
        b, h, n, d = q.shape
        groups = h // k.shape[1]  # grouped-query attention: the kernel shares each kv head over `groups` query heads
        k, v = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (k, v))
        if mask is not None:  # bool (True: attend) -> additive, as SDPA hands the kernel; broadcast to (b, h, n, m)
            mask = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else mask
            mask = mask.float().expand(b, h, n, k.shape[2]).reshape(b * h, n, k.shape[2])
        flat = [_flat_fp32(t) for t in (q, k, v)]
        return cls(*flat, mask, is_causal, scale if scale is not None else d ** -0.5, (b, h))

    def chunks(self) -> Iterator[tuple[int, int]]:
        """Query rows [start, stop) in chunks of at most ATTENTION_CHUNK_VALUES scores."""
        n, rows = self.q.shape[1], max(1, ATTENTION_CHUNK_VALUES // max(1, self.q.shape[0] * self.k.shape[1]))
        return ((start, min(n, start + rows)) for start in range(0, n, rows))

    def scores(self, start: int, stop: int) -> tuple[torch.Tensor, int]:
        """scale * q @ k^T + mask for query rows [start, stop) and the keys they may see (causal: up to stop), in
        one baddbmm: the kernel's values (fp32 products of bf16 q, k; scale applied to the sum; mask added)."""
        keys = min(self.k.shape[1], stop) if self.is_causal else self.k.shape[1]
        q, k_t = self.q[:, start:stop], self.k[:, :keys].transpose(1, 2)
        additive = self.mask[:, start:stop, :keys] if self.mask is not None else None
        if self.is_causal:  # top-left aligned, as SDPA's is_causal: key j is seen by query i when j <= i
            future = torch.ones(stop - start, keys, dtype=torch.bool).triu_(start + 1)
            causal = torch.zeros(stop - start, keys).masked_fill_(future, float("-inf"))
            additive = causal if additive is None else additive + causal
        if additive is None:
            return torch.bmm(q, k_t).mul_(self.scale), keys
        return torch.baddbmm(additive, q, k_t, alpha=self.scale), keys

    def unflat(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(0, self.heads)


def _flat_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32, memory_format=torch.contiguous_format).flatten(0, 1)


def _round_(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to bf16 values in place (its memory reused: these are the largest tensors of the step)."""
    return t.copy_(t.to(torch.bfloat16))


def _arg(args: Sequence[Any], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    """An aten argument that may come positionally, by name or not at all (its default)."""
    return args[index] if len(args) > index else kwargs.get(name, default)


def _attention_fwd(func: Any, args: Sequence[Any], kwargs: dict[str, Any], widen: Widen) -> Any:
    """The bf16 CPU flash kernel, emulated: scores from bf16 q, k with fp32 accumulation; softmax numerator
    exp(s - max) in fp32, summed in fp32 and rounded to bf16 before P @ V (as the bf16 kernel and a GPU's flash
    attention do); output rounded to bf16, logsumexp in fp32. Query rows in chunks so the scores stay small."""
    q, k, v = args[:3]
    if (att := _Attention.of(q, k, v, args, kwargs, 3)) is None:
        return func(*args, **kwargs)
    out = torch.empty(att.q.shape)
    lse = torch.empty(att.q.shape[:2])
    for start, stop in att.chunks():
        s, keys = att.scores(start, stop)
        # A fully masked row: max -inf -> 0 and sum 0 -> 1, as in the kernel, so its output is 0 and its lse 0.
        peak = s.amax(-1, keepdim=True).nan_to_num_(0.0, posinf=0.0, neginf=0.0)
        numerator = s.sub_(peak).exp_()
        total = numerator.sum(-1, keepdim=True)
        total.masked_fill_(total == 0, 1.0)
        torch.bmm(_round_(numerator), att.v[:, :keys], out=out[:, start:stop])
        out[:, start:stop].mul_(total.reciprocal())
        lse[:, start:stop] = (peak + total.log()).squeeze(-1)
    lse_kernel_layout = torch.empty(q.shape[0], q.shape[2], q.shape[1]).permute(0, 2, 1)  # memory: batch, query, head
    return att.unflat(out).to(torch.bfloat16), lse_kernel_layout.copy_(att.unflat(lse))


def _attention_bwd(func: Any, args: Sequence[Any], kwargs: dict[str, Any], widen: Widen) -> Any:
    """The bf16 CPU flash backward, emulated: probabilities recomputed in fp32 from the logsumexp, P and dS rounded
    to bf16 before their matmuls (as the bf16 kernel does), every matmul accumulated in fp32, grads rounded once
    (the kernel rounds its dK, dV accumulators to bf16 after each block of 32-256 queries; a GPU does not)."""
    grad_out, q, k, v, out, lse = args[:6]
    if (att := _Attention.of(q, k, v, args, kwargs, 6)) is None:
        return func(*args, **kwargs)
    d_out, o, lse = _flat_fp32(grad_out), _flat_fp32(out), lse.float().flatten(0, 1)
    delta = (d_out * o).sum(-1, keepdim=True)  # rowsum(dO * O), as the kernel's dsum
    d_q, d_k, d_v = torch.empty_like(att.q), torch.zeros_like(att.k), torch.zeros_like(att.v)
    for start, stop in att.chunks():
        s, keys = att.scores(start, stop)
        p = s.sub_(lse[:, start:stop, None]).exp_()
        d_o = d_out[:, start:stop]
        d_v[:, :keys].baddbmm_(_round_(p.clone()).transpose(1, 2), d_o)
        d_p = torch.bmm(d_o, att.v[:, :keys].transpose(1, 2))
        d_s = _round_(p.mul_(d_p.sub_(delta[:, start:stop])))
        torch.bmm(d_s, att.k[:, :keys], out=d_q[:, start:stop]).mul_(att.scale)
        d_k[:, :keys].baddbmm_(d_s.transpose(1, 2), att.q[:, start:stop], alpha=att.scale)
    d_q, d_k, d_v = (att.unflat(t) for t in (d_q, d_k, d_v))
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # each shared kv head gets the sum over its query heads
        d_k, d_v = (t.unflatten(1, (k.shape[1], groups)).sum(2) for t in (d_k, d_v))
    return d_q.to(torch.bfloat16), d_k.to(torch.bfloat16), d_v.to(torch.bfloat16)


_HANDLERS: dict[Any, Callable[[Any, Sequence[Any], dict[str, Any], Widen], Any]] = {
    **{getattr(aten, name): _gemm for name in _GEMMS if hasattr(aten, name)},
    _ATTENTION_FWD: _attention_fwd, _ATTENTION_BWD: _attention_bwd}
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


class Bf16Emulation(TorchDispatchMode):
    """Each bf16 gemm-type aten op on CPU as an fp32 gemm rounded to bf16. Open it inside bf16 autocast, around
    forward *and* backward.
    `calls` counts the ops it replaced (0 after a step means it covered nothing: worth a warning)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self._wide = _WideCache()

    def __exit__(self, *exc: Any) -> Any:
        self._wide = _WideCache()  # nothing outlives the context
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if _is_composite(func):  # under inference_mode composite ops (matmul, linear, SDPA) arrive whole:
            with self:  # decomposed here, their gemms come back through this mode
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        # the plain and out= overloads only: `.dtype` ones (fp32 results from bf16) have no CPU kernel to stand in for
        handler = _HANDLERS.get(func.overloadpacket) if func._schema.overload_name in ("", "out") else None
        if handler is None or not _emulable(args, kwargs):
            if getattr(func, "_defined_in_python", False) and _emulable(args, kwargs):
                # A custom op defined in Python, on bf16 (bitsandbytes' 4-bit gemm: dequantize, then F.linear): its
                # CPU kernel runs with this mode on, so the gemms inside it come back here. (Ops defined in C++,
                # c10d's collectives among them, are left alone.)
                with self:
                    return func.redispatch(_CPU_KEYS, *args, **kwargs)
            return func(*args, **kwargs)
        self.calls += 1
        return handler(func, args, kwargs, self._wide.widen)


@cache
def _is_composite(func: Any) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


@dataclass(frozen=True)
class Bf16Probe:
    """Matmul time of torch's own bf16 and of the emulation, each over fp32's, measured on this CPU."""

    native_slowdown: float
    """torch's bf16 matmul over fp32's: ~0.1 with AVX512-BF16, ~10-30 on an AVX2-only CPU."""
    emulated_slowdown: float
    """the emulation (widen, fp32 matmul, round) over fp32's: ~1.1-1.5."""
    seconds: float


def probe_bf16_slowdown(size: int = 256, budget_s: float = 0.25) -> Bf16Probe:
    """Time a size x size matmul in fp32, in torch's bf16 and emulated, alternating, for about `budget_s`, on one
    thread: the factors per core. Robust to busy cores (`cpu_matmul.fastest_calls`: at load 5 on 2 cores, 2 threads
    read torch's bf16 as 1.3x fp32's where it is ~50x; wall time on one thread read 88-131x at load 10, as the slow
    calls were preempted). 256 is large enough for MKL's sgemm to be efficient and small enough that the slow bf16
    gemm (~2 GFLOP/s) takes ~20 ms a call. The emulated arm is what `Bf16Emulation` runs for a gemm, without
    entering the mode, whose first entry imports torch._dynamo (~1 s). torch's fallback gemm runs on one thread
    whatever `torch.get_num_threads()` says, so on T threads a run's bf16 is up to T times further behind (measured:
    docs/explanation/performance.md, "bf16 on a CPU without native bf16")."""
    start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    arms: dict[str, Callable[[], Any]] = {"fp32": lambda: a32 @ b32, "bf16": lambda: a16 @ b16,
                                          "emulated": lambda: (a16.float() @ b16.float()).bfloat16()}
    with torch.inference_mode():
        best = fastest_calls(arms, lambda rounds: time.perf_counter() - start <= budget_s)
    fp32 = max(best["fp32"], 1e-9)
    return Bf16Probe(best["bf16"] / fp32, best["emulated"] / fp32, time.perf_counter() - start)


def use_bf16_emulation(precision: str, device_type: str, bf16_support: str, probe: Bf16Probe | None = None) -> bool:
    """Whether a run should emulate bf16 (`bf16_support` as `llmexp.machine.precision.bf16_support` says). The
    probe's comparison matters on a CPU with AVX512 but no AVX512-BF16: oneDNN's own emulation may be as fast."""
    if precision != "bf16" or device_type != "cpu":
        return False
    forced = os.environ.get(EMULATION_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return bf16_support == "emulated" and (probe is None or probe.emulated_slowdown < probe.native_slowdown)


def emulation_message(probe: Bf16Probe, emulating: bool) -> str:
    """The start-up line of a bf16 run on a CPU without native bf16."""
    head = "precision=bf16 on a CPU without native bf16 (AVX512-BF16 or AMX)"
    native = f"torch's bf16 matmuls measured {probe.native_slowdown:.1f}x fp32's time on this CPU"
    if emulating:
        return (f"{head}: {native}, so llmexp emulates bf16 (bf16-rounded operands and results, fp32 accumulation), "
                f"whose matmuls measured {probe.emulated_slowdown:.1f}x fp32's")
    return f"{head}: {native}, and matmuls dominate a training step"


def settle_on_cpu(precision: Precision) -> Precision:
    """A CPU run's precision with the bf16 path decided by the probe (~0.25 s), whose measured factors the
    warning states, not a guess."""
    if precision.name != "bf16" or (precision.bf16 != "emulated" and os.environ.get(EMULATION_ENV) != "1"):
        return precision
    probe = probe_bf16_slowdown()
    emulate = use_bf16_emulation(precision.name, "cpu", precision.bf16, probe)
    return replace(
        precision, emulate_bf16=emulate,
        bf16_slowdown=probe.emulated_slowdown if emulate else probe.native_slowdown,
        warning=emulation_message(probe, emulate) if precision.bf16 == "emulated" else None)
