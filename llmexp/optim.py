"""8-bit AdamW that is fast on CPU: bitsandbytes' blockwise algorithm as one fused torch kernel.

bitsandbytes' `AdamW8bit` keeps both Adam moments in 8 bits (its signed and unsigned "dynamic"
quantisation maps, one fp32 absmax per block of 256 values), so the state is ~0.25x AdamW's.
On CPU its step is slow: per tensor it dequantises both moments into fp32 copies (a C call),
runs about ten separate elementwise torch ops over them, and quantises them back (two more C
calls), so every element crosses memory some twenty times.

This class runs the same algorithm (the same maps, block size, update order and state layout:
`state1`/`state2` uint8, `absmax1`/`absmax2` fp32) as a single torch.compile'd function per
tensor: the dequantise, the moment updates, the weight update, the block absmax and the
re-quantisation fuse into one pass over memory. Without a working compiler it runs the same
function eagerly (correct, slower). Tensors under `min_8bit_size` values keep fp32 moments,
as in bitsandbytes.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

BLOCK_SIZE = 256
"""Values per absmax block (bitsandbytes' blockwise size)."""


def fused_cpu_available() -> bool:
    """True when torch.compile can build CPU kernels here (it needs a C++ compiler)."""
    import shutil

    return any(shutil.which(name) for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if name)


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


COMPILE_OPTIONS = {"assert_indirect_indexing": False}
"""Indices come from uint8 codes and 17-bit cells, always inside the 256- and 2^17-entry tables."""

CELL_SHIFT = 15
"""Quantising looks the float's top 17 bits (sign, exponent, 8 mantissa bits) up in a table."""


def nearest_table(midpoints: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A lookup that replaces `torch.bucketize(x, midpoints)` (a binary search, ~35 ns a value on CPU).

    The float32 bit patterns are cut into 2^17 cells (sign, exponent, top 8 mantissa bits); each
    cell is narrower than the gap between two midpoints of bitsandbytes' maps, so it holds at most
    one. `table[cell]` counts the midpoints below the cell; one comparison with the next midpoint
    finishes the job: `q = table[cell] + (x > padded[table[cell]])` equals bucketize exactly.
    """
    cells = torch.arange(1 << (32 - CELL_SHIFT), dtype=torch.int64)
    negative = cells >> (31 - CELL_SHIFT) == 1
    low_bits = torch.where(negative, ((cells + 1) << CELL_SHIFT) - 1, cells << CELL_SHIFT)  # the cell's least value
    high_bits = torch.where(negative, cells << CELL_SHIFT, ((cells + 1) << CELL_SHIFT) - 1)

    def as_float(bits: torch.Tensor) -> torch.Tensor:
        return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)

    low, high = as_float(low_bits), as_float(high_bits)
    table = torch.bucketize(low, midpoints)
    finite = torch.isfinite(low) & torch.isfinite(high)
    if (torch.bucketize(high, midpoints) - table)[finite].max() > 1:
        raise ValueError("nearest_table: a cell holds two midpoints; the map is too fine for this lookup")
    padded = torch.cat([midpoints, torch.full((1,), math.inf)])
    return table.to(torch.uint8), padded


def _quantize(x: torch.Tensor, table: torch.Tensor, padded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise: x (blocks, B) fp32 -> (uint8 index of the nearest code value, absmax per block (blocks, 1))."""
    absmax = x.abs().amax(dim=1, keepdim=True)
    scaled = x / absmax.clamp(min=1e-30)
    cell = (scaled.view(torch.int32) >> CELL_SHIFT) & ((1 << (32 - CELL_SHIFT)) - 1)
    below = table[cell].int()
    return (below + (scaled > padded[below]).int()).to(torch.uint8), absmax


def adam8bit_update(p: torch.Tensor, g: torch.Tensor, q1: torch.Tensor, a1: torch.Tensor, q2: torch.Tensor,
                    a2: torch.Tensor, code1: torch.Tensor, table1: torch.Tensor, padded1: torch.Tensor,
                    code2: torch.Tensor, table2: torch.Tensor, padded2: torch.Tensor, hyper: torch.Tensor) -> None:
    """One AdamW step of one tensor, in place. Shapes: p, g, q1, q2 (blocks, B); a1, a2 (blocks, 1).

    hyper = [beta1, beta2, eps, decay factor (1 - lr*wd), step size (lr / bias correction 1),
    sqrt(bias correction 2)] as a fp32 tensor, so that a new lr does not recompile anything.
    """
    beta1, beta2, eps, decay, step_size, correction2 = hyper.unbind()
    grad = g.float()
    m = code1[q1.int()] * a1 * beta1 + grad * (1 - beta1)
    v = code2[q2.int()] * a2 * beta2 + grad * grad * (1 - beta2)
    new_p = p.float() * decay - step_size * m / (v.sqrt() / correction2 + eps)
    p.copy_(new_p)
    new_q1, new_a1 = _quantize(m, table1, padded1)
    new_q2, new_a2 = _quantize(v, table2, padded2)
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


class AdamW8bit(torch.optim.Optimizer):
    """AdamW with 8-bit blockwise moments; bitsandbytes' algorithm and state layout, fused for CPU.

    `compile=None` compiles where a compiler works and falls back to eager with a warning.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, min_8bit_size: int = 4096,
                 compile: bool | None = None) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"AdamW8bit: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.min_8bit_size = min_8bit_size
        self._compile = compile
        self._update: Callable[..., None] | None = None
        self._maps: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _maps_on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(code, table, padded midpoints) of the signed map (first moment), then of the unsigned one."""
        if device not in self._maps:
            maps: list[torch.Tensor] = []
            for signed in (True, False):
                code = dynamic_map(signed)
                maps += [code, *nearest_table((code[:-1] + code[1:]) / 2)]
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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch casts every loaded state tensor to the parameter's dtype; the 8-bit moments go back to uint8."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            if "absmax1" in state:
                state["state1"] = state["state1"].to(torch.uint8)
                state["state2"] = state["state2"].to(torch.uint8)

    def _updater(self) -> Callable[..., None]:
        if self._update is None:
            self._update = adam8bit_update
            if self._compile is not False:  # static block and map sizes; the block count is marked dynamic
                self._update = torch.compile(adam8bit_update, dynamic=False, options=COMPILE_OPTIONS)
        return self._update

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
                hyper = torch.tensor([beta1, beta2, group["eps"], 1 - group["lr"] * group["weight_decay"],
                                      group["lr"] / (1 - beta1**step), math.sqrt(1 - beta2**step)],
                                     dtype=torch.float32, device=p.device)
                if state["state1"].dtype == torch.float32:
                    adam32bit_update(p, p.grad, state["state1"], state["state2"], hyper)
                else:
                    self._step_8bit(p, state, hyper)
        return loss

    def _step_8bit(self, p: torch.Tensor, state: dict[str, Any], hyper: torch.Tensor) -> None:
        if not p.is_contiguous():
            raise RuntimeError("AdamW8bit needs contiguous parameters")
        maps = self._maps_on(p.device)
        flat = (p.view(-1), p.grad.reshape(-1), state["state1"].view(-1), state["state2"].view(-1))
        full = (p.numel() // BLOCK_SIZE) * BLOCK_SIZE
        a1, a2 = state["absmax1"].view(-1, 1), state["absmax2"].view(-1, 1)
        parts = []
        if full:
            parts.append(([t[:full].view(-1, BLOCK_SIZE) for t in flat], a1[: full // BLOCK_SIZE],
                          a2[: full // BLOCK_SIZE]))
        if full < p.numel():  # the last, partial block
            parts.append(([t[full:].view(1, -1) for t in flat], a1[-1:], a2[-1:]))
        if full:
            (pp, gg, q1, q2), aa1, aa2 = parts[0]
            for t in (pp, gg, q1, q2, aa1, aa2):
                torch._dynamo.maybe_mark_dynamic(t, 0)  # one kernel for every tensor size
            self._run(pp, gg, q1, aa1, q2, aa2, *maps, hyper)
        if full < p.numel():  # the last, partial block: fewer than BLOCK_SIZE values, run eagerly
            (pp, gg, q1, q2), aa1, aa2 = parts[-1]
            adam8bit_update(pp, gg, q1, aa1, q2, aa2, *maps, hyper)

    def _run(self, *args: torch.Tensor) -> None:
        try:
            self._updater()(*args)
        except Exception as err:  # no working compiler: the eager function is the same math
            if self._update is adam8bit_update or self._compile:
                raise
            warnings.warn(f"AdamW8bit: torch.compile failed ({type(err).__name__}: {err}); running eagerly "
                          "(correct, slower)", stacklevel=3)
            self._update = adam8bit_update
            adam8bit_update(*args)
