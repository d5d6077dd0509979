"""The precision a run computes in on this machine: whether its CPU or GPU does bf16 natively, what `precision=auto`
resolves to, and the warning for emulated bf16. Resolved once at set-up (`precision_on`) and handed on; the CLI's
checks, `python -m llmexp.estimate` and the trainer all ask here. No torch at import (CUDA is asked only for a GPU
run)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from llmexp.errors import UserError


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 dot products (AVX512-BF16 or AMX). LLMEXP_ASSUME_NO_BF16=1 answers False
    (older hardware simulated), read on every call, outside the cache of the CPU's flags, so it takes effect at once."""
    return os.environ.get("LLMEXP_ASSUME_NO_BF16") != "1" and _cpu_flags_have_bf16()


@cache
def _cpu_flags_have_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_support(device_type: str) -> str:
    """`native` (fast bf16 matmuls), `emulated` (torch runs bf16 in software or converts, slowly) or `none`. Every
    x86/ARM CPU runs bf16 autocast, natively or emulated; on CUDA, Ampere and newer are native, older GPUs `emulated`
    when torch can compute bf16 there (its own `including_emulation` test)."""
    if device_type == "cpu":
        return "native" if cpu_has_fast_bf16() else "emulated"
    import torch

    if device_type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "native"
        return "emulated" if torch.cuda.is_bf16_supported(including_emulation=True) else "none"
    return "native"  # mps, xpu: torch decides; autocast raises its own clear error if it cannot


def resolve_precision(name: str, device_type: str) -> str:
    """bf16/fp16/fp32 for this device; `auto` picks bf16 where it is native (fast), else fp32. `precision=bf16`
    runs wherever torch can run it (emulated: `bf16_emulation_warning`)."""
    support = bf16_support(device_type)
    if name == "auto":
        return "bf16" if support == "native" else "fp32"
    if name == "bf16" and support == "none":
        raise UserError("precision=bf16: torch cannot compute in bf16 on this GPU (not even emulated). "
                        "Use precision=auto (fp32 here) or precision=fp16.")
    return name


def bf16_emulation_warning(precision: str, device_type: str) -> str | None:
    if precision != "bf16" or bf16_support(device_type) != "emulated":
        return None
    if device_type == "cpu":  # set-up measures the slowdown and says it (`model.bf16_emulation.settle_on_cpu`)
        return "precision=bf16 on a CPU without native bf16 (AVX512-BF16 or AMX)"
    return ("precision=bf16 on a GPU without native bf16 (before Ampere): torch emulates it, so training is "
            "expected to be slower than fp32")


BF16_EMULATION_ADVICE = ("Use precision=auto (fp32 on this hardware) for the faster run; keep bf16 only to "
                         "match bf16 numerics.")


@dataclass(frozen=True)
class Precision:
    """The precision a run computes in on this device, resolved once at set-up (`precision_on`): `requested`
    (`precision.name`), `name` (what it computes in: bf16, fp16 or fp32), this device's `bf16` (native, emulated
    or none), and the `warning` when it computes in emulated bf16 (on a CPU with the factors measured at set-up)."""

    requested: str
    name: str
    bf16: str
    warning: str | None
    emulate_bf16: bool = False
    """llmexp emulates bf16 on fp32 kernels (a CPU whose own bf16 matmuls are slower: `model.bf16_emulation`)."""
    bf16_slowdown: float | None = None
    """The bf16 path's matmul time over fp32's, measured on this CPU at set-up (None where not measured)."""


def precision_on(requested: str, device_type: str) -> Precision:
    name = resolve_precision(requested, device_type)
    return Precision(requested=requested, name=name, bf16=bf16_support(device_type),
                     warning=bf16_emulation_warning(name, device_type))
