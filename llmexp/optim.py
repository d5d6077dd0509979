"""8-bit AdamW that is fast on CPU: bitsandbytes' blockwise algorithm in one pass over memory.

bitsandbytes' `AdamW8bit` keeps both Adam moments in 8 bits (its signed and unsigned "dynamic"
quantisation maps, one fp32 absmax per block of 256 values), so the state is ~0.25x AdamW's.
On CPU its step is slow: per tensor it dequantises both moments into fp32 copies (a C call),
runs about ten separate elementwise torch ops over them, and quantises them back (two more C
calls), so every element crosses memory some twenty times.

This class runs the same algorithm (the same maps, block size, update order and state layout:
`state1`/`state2` uint8, `absmax1`/`absmax2` fp32). `adam8bit_update` below is the algorithm in
torch, the readable reference; `adam8bit.c` computes the same (the tests hold the moments to it
bit for bit, the weights to an ulp: torch's vectorised sqrt is not correctly rounded) in one
pass: each 256-value block is dequantised, updated and re-quantised while it sits in L1, and one
call steps every tensor of the model across all threads, so a step costs about twice fused
AdamW's. Without a C compiler it runs the torch reference (correct, slower).
Tensors under `min_8bit_size` values keep fp32 moments, as in bitsandbytes.
"""

from __future__ import annotations

import ctypes
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

BLOCK_SIZE = 256
"""Values per absmax block (bitsandbytes' blockwise size)."""


def cpu_kernel_available() -> bool:
    """True when the C kernel can be built here (it needs a C compiler)."""
    from llmexp import native

    return native.c_compiler() is not None


def dynamic_map(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' dynamic quantisation map (`functional.create_dynamic_map`), 256 sorted fp32 values.

    A decimal exponent and a linear fraction: fine steps near zero, coarse ones near +-1.
    """
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        extra = 0 if signed else 1
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits + extra) + 1)
        bounds = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += (scale * means).tolist()  # an fp32 product, as in bitsandbytes: the same bits
        if signed:
            data += (-scale * means).tolist()
    if additional_items > 0:  # not reached with the defaults (7 exponent bits of 8)
        raise NotImplementedError("dynamic_map: additional_items > 0")
    data += [0.0, 1.0]
    data += [0.0] * (2**total_bits - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


CELL_SHIFT = 15
"""Quantising looks the float's top 17 bits (sign, exponent, 8 mantissa bits) up in a table."""
LOW_MASK = (1 << CELL_SHIFT) - 1
NO_MIDPOINT = 1 << CELL_SHIFT
"""A threshold no 15-bit key exceeds: the cell holds no midpoint."""


def _key(bits: torch.Tensor) -> torch.Tensor:
    """The low 15 bits of a float32, ordered as the floats of one cell are (reversed for negatives)."""
    return (bits & LOW_MASK) ^ torch.where(bits < 0, LOW_MASK, 0)


def nearest_table(midpoints: torch.Tensor) -> torch.Tensor:
    """A lookup that replaces `torch.bucketize(x, midpoints)` (a binary search, ~35 ns a value on CPU).

    The float32 bit patterns are cut into 2^17 cells (sign, exponent, top 8 mantissa bits); each
    cell is narrower than the gap between two midpoints of bitsandbytes' maps, so it holds at most
    one. Each int32 entry packs `below << 16 | threshold`: the midpoints below the cell, and the
    key (`_key`) of the midpoint inside it, or NO_MIDPOINT. Then `q = below + (key(x) > threshold)`
    equals bucketize exactly, with one table load per value.
    """
    cells = torch.arange(1 << (32 - CELL_SHIFT), dtype=torch.int64)
    negative = cells >> (31 - CELL_SHIFT) == 1
    low_bits = torch.where(negative, ((cells + 1) << CELL_SHIFT) - 1, cells << CELL_SHIFT)  # the cell's least value
    high_bits = torch.where(negative, cells << CELL_SHIFT, ((cells + 1) << CELL_SHIFT) - 1)

    def as_float(bits: torch.Tensor) -> torch.Tensor:
        return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)

    low, high = as_float(low_bits), as_float(high_bits)
    below = torch.bucketize(low, midpoints)
    finite = torch.isfinite(low) & torch.isfinite(high)
    if (torch.bucketize(high, midpoints) - below)[finite].max() > 1:
        raise ValueError("nearest_table: a cell holds two midpoints; the map is too fine for this lookup")
    padded = torch.cat([midpoints, torch.full((1,), math.inf)])
    inside = padded[below] <= high  # the next midpoint lies in this cell
    threshold = torch.where(inside, _key(padded[below].view(torch.int32)), NO_MIDPOINT)
    return ((below << 16) | threshold).to(torch.int32)


def _quantize(x: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise: x (blocks, B) fp32 -> (uint8 index of the nearest code value, absmax per block (blocks, 1))."""
    absmax = x.abs().amax(dim=1, keepdim=True)
    bits = (x / absmax.clamp(min=1e-30)).view(torch.int32)
    entry = table[(bits >> CELL_SHIFT) & ((1 << (32 - CELL_SHIFT)) - 1)]
    return ((entry >> 16) + (_key(bits) > (entry & 0xFFFF)).int()).to(torch.uint8), absmax


def adam8bit_update(p: torch.Tensor, g: torch.Tensor, q1: torch.Tensor, a1: torch.Tensor, q2: torch.Tensor,
                    a2: torch.Tensor, code1: torch.Tensor, table1: torch.Tensor, code2: torch.Tensor,
                    table2: torch.Tensor, hyper: torch.Tensor) -> None:
    """One AdamW step of one tensor, in place. Shapes: p, g, q1, q2 (blocks, B); a1, a2 (blocks, 1).

    hyper = [beta1, beta2, eps, decay factor (1 - lr*wd), step size (lr / bias correction 1),
    sqrt(bias correction 2)] as a fp32 tensor: the scalars round as the C kernel's fp32 ones do.
    """
    beta1, beta2, eps, decay, step_size, correction2 = hyper.unbind()
    grad = g.float()
    m = code1[q1.int()] * a1 * beta1 + grad * (1 - beta1)
    v = code2[q2.int()] * a2 * beta2 + grad * grad * (1 - beta2)
    new_p = p.float() * decay - step_size * m / (v.sqrt() / correction2 + eps)
    p.copy_(new_p)
    new_q1, new_a1 = _quantize(m, table1)
    new_q2, new_a2 = _quantize(v, table2)
    q1.copy_(new_q1)
    a1.copy_(new_a1)
    q2.copy_(new_q2)
    a2.copy_(new_a2)


def adam32bit_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                     hyper: torch.Tensor) -> None:
    """The same step with fp32 moments (small tensors), in place."""
    beta1, beta2, eps, decay, step_size, correction2 = hyper.unbind()
    grad = g.float()
    m.mul_(beta1).add_(grad * (1 - beta1))
    v.mul_(beta2).add_(grad * grad * (1 - beta2))
    p.mul_(decay).sub_(step_size * m / (v.sqrt() / correction2 + eps))


QUANT_STATE_KEYS = ("state1", "state2", "absmax1", "absmax2")
"""The 8-bit moments (uint8) and their per-block absmax (fp32)."""
BNB_NESTED_KEY = "__bnb_optimizer_quant_state__"
"""Where bitsandbytes' state_dict puts the 8-bit tensors (hidden from FSDP's gather)."""


def _unnest(state: Any) -> Any:
    if isinstance(state, dict) and BNB_NESTED_KEY in state:
        return {**{k: v for k, v in state.items() if k != BNB_NESTED_KEY}, **state[BNB_NESTED_KEY]}
    return state


class _Tensor8(ctypes.Structure):
    """adam8bit.c's `Tensor8`: one tensor's pointers, size and hyperparameters."""

    _fields_ = [("p", ctypes.c_void_p), ("g", ctypes.c_void_p), ("q1", ctypes.c_void_p), ("q2", ctypes.c_void_p),
                ("a1", ctypes.c_void_p), ("a2", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("hyper", ctypes.c_float * 6)]


class _Map(ctypes.Structure):
    """adam8bit.c's `Map`: a quantisation map and its cell table."""

    _fields_ = [("code", ctypes.c_void_p), ("table", ctypes.c_void_p)]


class AdamW8bit(torch.optim.Optimizer):
    """AdamW with 8-bit blockwise moments; bitsandbytes' algorithm and state layout, fast on CPU.

    `native=None` uses the C kernel where it builds and falls back to the torch reference with a
    warning; `True` requires the kernel; `False` always runs the reference.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, min_8bit_size: int = 4096,
                 native: bool | None = None) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"AdamW8bit: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.min_8bit_size = min_8bit_size
        self._native = native
        self._lib: Any = None
        self._maps: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _maps_on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(code, table) of the signed map (first moment), then of the unsigned one."""
        if device not in self._maps:
            maps: list[torch.Tensor] = []
            for signed in (True, False):
                code = dynamic_map(signed)
                maps += [code, nearest_table((code[:-1] + code[1:]) / 2)]
            self._maps[device] = tuple(t.to(device) for t in maps)
        return self._maps[device]

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = 0
        if p.numel() < self.min_8bit_size:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            return state
        blocks = math.ceil(p.numel() / BLOCK_SIZE)
        state["state1"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
        state["state2"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        return state

    def state_dict(self) -> dict[str, Any]:
        """torch's, plus bitsandbytes' `qmap1`/`qmap2` per 8-bit tensor, so its AdamW8bit can resume from it."""
        out = super().state_dict()
        code1, _, code2, _ = self._maps_on(torch.device("cpu"))
        out["state"] = {k: {**v, "qmap1": code1, "qmap2": code2} if "absmax1" in v else v
                        for k, v in out["state"].items()}  # new dicts: torch's hold the live per-parameter ones
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Ours or bitsandbytes' (which nests the 8-bit tensors under one key).

        torch casts every loaded state tensor to its parameter's dtype: the uint8 moments and the
        fp32 absmax (which a bf16 parameter would round) are therefore taken from the saved dict as
        they are, after torch has restored the rest.
        """
        saved = {k: _unnest(v) for k, v in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": saved})
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params, strict=True):
            state = self.state.get(p)
            if state is None:
                continue
            state.pop("qmap1", None)  # bitsandbytes' copies of the maps; ours are built here
            state.pop("qmap2", None)
            if "absmax1" in state:
                for key in QUANT_STATE_KEYS:
                    state[key] = saved[saved_id][key].to(p.device)

    def _kernel(self) -> Any:
        """adam8bit.c's library, or None (the torch reference runs) when it is off or cannot be built."""
        if self._lib is None and self._native is not False:
            from llmexp import native

            try:
                self._lib = native.load("adam8bit.c")
            except OSError as err:
                if self._native:
                    raise
                warnings.warn(f"AdamW8bit: no CPU kernel ({err}); running the torch reference (correct, slower)",
                              stacklevel=3)
                self._native = False
        return self._lib

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        batch: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any], list[float]]] = []  # for the C kernel
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW8bit does not support sparse gradients")
                state = self.state[p] if self.state[p] else self._init_state(p)
                state["step"] += 1
                step = state["step"]
                hyper = [beta1, beta2, group["eps"], 1 - group["lr"] * group["weight_decay"],
                         group["lr"] / (1 - beta1**step), math.sqrt(1 - beta2**step)]
                if state["state1"].dtype == torch.float32:
                    adam32bit_update(p, p.grad, state["state1"], state["state2"], self._hyper(hyper, p))
                elif self._fits_kernel(p) and self._kernel() is not None:
                    batch.append((p, p.grad.contiguous(), state, hyper))
                else:
                    self._step_reference(p, state, self._hyper(hyper, p))
        if batch:
            self._step_native(batch)
        return loss

    @staticmethod
    def _hyper(values: list[float], p: torch.Tensor) -> torch.Tensor:
        """As a fp32 tensor, so that the reference computes in the kernel's precision."""
        return torch.tensor(values, dtype=torch.float32, device=p.device)

    @staticmethod
    def _fits_kernel(p: torch.Tensor) -> bool:
        return p.device.type == "cpu" and p.dtype == p.grad.dtype == torch.float32 and p.is_contiguous()

    def _step_native(self, batch: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any], list[float]]]) -> None:
        """Every 8-bit fp32 CPU tensor in one call: the kernel splits all their blocks across torch's threads."""
        code1, table1, code2, table2 = self._maps_on(torch.device("cpu"))
        maps = (_Map * 2)(_Map(code1.data_ptr(), table1.data_ptr()), _Map(code2.data_ptr(), table2.data_ptr()))
        tensors = (_Tensor8 * len(batch))(*[
            _Tensor8(p.data_ptr(), g.data_ptr(), s["state1"].data_ptr(), s["state2"].data_ptr(),
                     s["absmax1"].data_ptr(), s["absmax2"].data_ptr(), p.numel(), (ctypes.c_float * 6)(*hyper))
            for p, g, s, hyper in batch])
        self._lib.adam8bit_step(tensors, ctypes.c_int64(len(batch)), maps, ctypes.c_int(torch.get_num_threads()))

    def _step_reference(self, p: torch.Tensor, state: dict[str, Any], hyper: torch.Tensor) -> None:
        """The torch reference over (blocks, 256) views, and the last, partial block on its own."""
        if not p.is_contiguous():
            raise RuntimeError("AdamW8bit needs contiguous parameters")
        maps = self._maps_on(p.device)
        flat = (p.view(-1), p.grad.reshape(-1), state["state1"].view(-1), state["state2"].view(-1))
        a1, a2 = state["absmax1"].view(-1, 1), state["absmax2"].view(-1, 1)
        full = (p.numel() // BLOCK_SIZE) * BLOCK_SIZE
        if full:
            pp, gg, q1, q2 = (t[:full].view(-1, BLOCK_SIZE) for t in flat)
            blocks = full // BLOCK_SIZE
            adam8bit_update(pp, gg, q1, a1[:blocks], q2, a2[:blocks], *maps, hyper)
        if full < p.numel():
            pp, gg, q1, q2 = (t[full:].view(1, -1) for t in flat)
            adam8bit_update(pp, gg, q1, a1[-1:], q2, a2[-1:], *maps, hyper)
