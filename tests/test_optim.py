"""8-bit optimizers: bitsandbytes' own classes on every device, and their state through llmexp's checkpoints.

llmexp builds `optimizer=adamw8bit` / `paged_adamw8bit` as bitsandbytes' classes on CPU and GPU alike
(no kernel of our own). What llmexp must guarantee is that their state survives its checkpoint format
(tensors and plain data, loaded with `weights_only=True`): a resumed optimizer steps exactly as the
uninterrupted one, for fp32 and bf16 parameters.
"""

from __future__ import annotations

from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch

from llmexp.checkpoint.serialize import load_state, save_state

SHAPES = [(64, 256), (300,), (1000, 7)]
"""8-bit state, fp32 state (below bitsandbytes' min_8bit_size), 8-bit with a partial last block."""


def _steps(make: type, params: list[torch.nn.Parameter], num_steps: int, seed: int) -> torch.optim.Optimizer:
    gen = torch.Generator().manual_seed(seed)
    opt = make(params, lr=1e-3)
    for _ in range(num_steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
        opt.step()
    return opt


@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit"])
def test_llmexp_builds_bitsandbytes_class_on_cpu(name: str, tmp_path: Path) -> None:
    from llmexp.model.build import build_model, build_optimizer
    from tests.conftest import TINY, compose

    cfg = compose([*TINY, f"optimizer={name}"], tmp_path / "run")
    model = build_model(cfg, cfg.model.vocab_size)
    opt = build_optimizer(cfg, model, 1e-3, "cpu")
    assert type(opt) is (bnb.optim.AdamW8bit if name == "adamw8bit" else bnb.optim.PagedAdamW8bit)


@pytest.mark.parametrize("make", [bnb.optim.AdamW8bit, bnb.optim.PagedAdamW8bit])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_through_a_checkpoint_continues_bitwise(make: type, dtype: torch.dtype, tmp_path: Path) -> None:
    """Save after 3 steps, load into a fresh optimizer, take the 4th step on both: identical weights and state."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    opt = _steps(make, params, num_steps=3, seed=1)
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = make(clone, lr=1e-3)
    save_state(tmp_path / "optimizer.pt", opt.state_dict())  # llmexp's checkpoint format (no pickle code)
    resumed.load_state_dict(load_state(tmp_path / "optimizer.pt"))
    assert resumed.state[clone[0]]["state1"].dtype == torch.uint8
    assert resumed.state[clone[0]]["absmax1"].dtype == torch.float32  # not cast to a bf16 parameter's dtype
    gen = torch.Generator().manual_seed(2)
    grads = [(torch.randn(p.shape, generator=gen) * 1e-2).to(dtype) for p in params]
    for o, ps in ((opt, params), (resumed, clone)):
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
        o.step()
    for p, q in zip(params, clone, strict=True):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            if torch.is_tensor(value):
                assert torch.equal(value, resumed.state[q][key]), key


def test_eight_bit_state_is_a_quarter_of_adamw() -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(256, 256), (688, 256)]

    def state_bytes(make: type) -> int:
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        opt = _steps(make, params, num_steps=1, seed=0)
        return sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items()
                   if torch.is_tensor(t) and not k.startswith("qmap") and t.numel() > 1)

    ratio = state_bytes(bnb.optim.AdamW8bit) / state_bytes(torch.optim.AdamW)
    assert 0.25 <= ratio <= 0.26  # uint8 moments + one fp32 absmax per 256-value block
