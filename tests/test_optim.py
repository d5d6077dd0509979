"""llmexp.optim.AdamW8bit: bitsandbytes' 8-bit blockwise AdamW, fast on CPU.

The torch reference is compared against bitsandbytes itself on real tensors, and the C kernel
(built here with the machine's compiler) against the torch reference.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from llmexp import native
from llmexp.optim import AdamW8bit, _quantize, dynamic_map, nearest_table


def test_maps_are_bitsandbytes_maps() -> None:
    functional = pytest.importorskip("bitsandbytes.functional")
    for signed in (True, False):
        assert torch.equal(dynamic_map(signed), functional.create_dynamic_map(signed=signed))


@pytest.mark.parametrize("signed", [True, False])
def test_table_lookup_equals_bucketize(signed: bool) -> None:
    code = dynamic_map(signed)
    mid = (code[:-1] + code[1:]) / 2
    table = nearest_table(mid)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=gen) * 10.0 ** torch.randint(-9, 2, (512, 1), generator=gen).float()
    x = x if signed else x.abs()
    q, absmax = _quantize(x, table)
    assert torch.equal(q.long(), torch.bucketize(x / absmax, mid))
    for edge in (mid, torch.nextafter(mid, torch.tensor(2.0)), torch.nextafter(mid, torch.tensor(-2.0))):
        q, _ = _quantize(torch.cat([edge, torch.ones(1)]).view(1, -1), table)  # absmax 1: scaled == edge
        assert torch.equal(q.long()[0, :-1], torch.bucketize(edge, mid))


def _three_steps(make: type, shapes: list[tuple[int, ...]], **kwargs: object) -> tuple[list, torch.optim.Optimizer]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * 1e-2 for s in shapes] for _ in range(3)]
    opt = make(params, lr=1e-3, **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g
        opt.step()
    return params, opt


def test_same_steps_as_bitsandbytes() -> None:
    """Same maps, blocks, order and state layout; only float rounding at quantisation boundaries differs."""
    bnb = pytest.importorskip("bitsandbytes")
    shapes = [(64, 256), (300,), (1000, 7)]  # 8-bit, fp32 (small), 8-bit with a partial last block
    ours, ours_opt = _three_steps(AdamW8bit, shapes, native=False)
    ref, ref_opt = _three_steps(bnb.optim.AdamW8bit, shapes)
    gen = torch.Generator().manual_seed(0)
    initial = [torch.randn(s, generator=gen) for s in shapes]  # what _three_steps started from
    for p, r, start in zip(ours, ref, initial, strict=True):
        a, b = ours_opt.state[p], ref_opt.state[r]
        assert a["state1"].dtype == b["state1"].dtype and a["state1"].shape == b["state1"].shape
        moved = (r - start).abs().mean()
        assert (p - r).abs().mean() < 0.01 * moved  # rare boundary cases differ, by under one step
        assert (p - r).abs().max() < 1e-3
        if a["state1"].dtype == torch.uint8:
            assert (a["state1"] != b["state1"]).float().mean() < 0.01
            assert (a["state2"] != b["state2"]).float().mean() < 0.01
            assert torch.allclose(a["absmax2"], b["absmax2"], rtol=1e-5)
        else:
            assert torch.allclose(a["state2"], b["state2"], rtol=1e-5)


def test_state_is_a_quarter_of_adamw() -> None:
    params, opt = _three_steps(AdamW8bit, [(256, 256), (688, 256)], native=False)
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                      if torch.is_tensor(t))
    adamw_bytes = 2 * 4 * sum(p.numel() for p in params)
    assert state_bytes <= 0.26 * adamw_bytes, state_bytes / adamw_bytes


@pytest.mark.parametrize("native", [False, True])
def test_state_dict_round_trip_continues_identically(native: bool, tmp_path: Path) -> None:
    from llmexp.ckpt_state import load_state, save_state

    params, opt = _three_steps(AdamW8bit, [(32, 256)], native=native)
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = AdamW8bit(clone, lr=1e-3, native=native)
    save_state(tmp_path / "optimizer.pt", opt.state_dict())  # llmexp's checkpoint format (no pickle code)
    opt2.load_state_dict(load_state(tmp_path / "optimizer.pt"))
    grad = torch.randn(32, 256)
    for o, ps in ((opt, params), (opt2, clone)):
        ps[0].grad = grad.clone()
        o.step()
    assert torch.equal(params[0], clone[0])


SHAPES = [(64, 256), (300,), (1000, 7), (513, 300), (3, 4096)]
"""8-bit, fp32 (small), 8-bit with partial last blocks, and a tensor of whole blocks."""


def _assert_same_steps(a: list, a_opt: torch.optim.Optimizer, b: list, b_opt: torch.optim.Optimizer) -> None:
    for x, y in zip(a, b, strict=True):
        for key, value in a_opt.state[x].items():
            if torch.is_tensor(value):  # the moments and absmax are computed without sqrt: identical
                assert torch.equal(value, b_opt.state[y][key]), key
        # torch's vectorised sqrt is not correctly rounded (the C sqrtf is): an ulp of the update at most
        assert (x - y).abs().max() <= 1e-6


def test_c_kernel_matches_the_torch_reference() -> None:
    assert native.c_compiler() is not None, "the test machine must have a C compiler (gcc)"
    reference, reference_opt = _three_steps(AdamW8bit, SHAPES, native=False)
    kernel, kernel_opt = _three_steps(AdamW8bit, SHAPES, native=True)
    assert kernel_opt._lib is not None
    _assert_same_steps(reference, reference_opt, kernel, kernel_opt)


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_c_kernel_splits_blocks_across_threads_exactly(threads: int) -> None:
    """Thread ranges cut tensors in the middle; every block must still be stepped exactly once."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, one_opt = _three_steps(AdamW8bit, SHAPES, native=True)
        torch.set_num_threads(threads)
        many, many_opt = _three_steps(AdamW8bit, SHAPES, native=True)
    finally:
        torch.set_num_threads(before)
    for x, y in zip(one, many, strict=True):
        assert torch.equal(x, y)
        assert all(torch.equal(v, many_opt.state[y][k]) for k, v in one_opt.state[x].items() if torch.is_tensor(v))


def test_without_a_working_compiler_the_reference_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: simulated failure' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    monkeypatch.setenv("LLMEXP_CACHE", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="simulated failure"):
        params, opt = _three_steps(AdamW8bit, SHAPES[:1])
    assert opt._lib is None
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-built left behind
    reference, _ = _three_steps(AdamW8bit, SHAPES[:1], native=False)
    assert torch.equal(params[0], reference[0])


@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit"])
def test_llmexp_builds_the_fast_class_on_cpu_only(name: str, tmp_path: Path) -> None:
    from llmexp.build import build_model, build_optimizer
    from tests.conftest import TINY, compose

    cfg = compose([*TINY, f"optimizer={name}"], tmp_path / "run")
    model = build_model(cfg, cfg.model.vocab_size)
    assert type(build_optimizer(cfg, model, 1e-3, "cpu")) is AdamW8bit
    on_gpu = build_optimizer(cfg, model, 1e-3, "cuda")  # what a GPU run gets: bitsandbytes' own class
    assert type(on_gpu).__module__.startswith("bitsandbytes.")


@pytest.mark.parametrize("direction", ["bitsandbytes -> llmexp", "llmexp -> bitsandbytes"])
def test_checkpoints_move_between_bitsandbytes_and_llmexp(direction: str) -> None:
    """A run saved with one class (bitsandbytes' on a GPU, ours on a CPU) continues with the other."""
    bnb = pytest.importorskip("bitsandbytes")
    first, second = ((bnb.optim.AdamW8bit, AdamW8bit) if direction.startswith("bitsandbytes")
                     else (AdamW8bit, bnb.optim.AdamW8bit))
    params, first_opt = _three_steps(first, [(64, 256)])
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    second_opt = second(clone, lr=1e-3)
    second_opt.load_state_dict(copy.deepcopy(first_opt.state_dict()))
    ours_opt, ours_param = (first_opt, params[0]) if first is AdamW8bit else (second_opt, clone[0])
    assert "qmap1" not in ours_opt.state[ours_param]  # the maps go into the saved dict, not the live state
    assert second_opt.state[clone[0]]["state1"].dtype == torch.uint8
    assert second_opt.state[clone[0]]["step"] == 3
    grad = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 1e-2
    for opt, ps in ((first_opt, params), (second_opt, clone)):
        ps[0].grad = grad.clone()
        opt.step()
    assert (params[0] - clone[0]).abs().max() < 1e-4  # the same fourth step, up to boundary rounding
    assert (first_opt.state[params[0]]["state1"] != second_opt.state[clone[0]]["state1"]).float().mean() < 0.01


def test_bf16_parameters_keep_fp32_absmax_through_a_checkpoint(tmp_path: Path) -> None:
    """torch's load casts state to the parameter dtype; the per-block absmax must not become bf16."""
    from llmexp.ckpt_state import load_state, save_state

    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 256, generator=gen).bfloat16())
    opt = AdamW8bit([p], lr=1e-3)
    p.grad = (torch.randn(64, 256, generator=gen) * 1e-2).bfloat16()
    opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = AdamW8bit([q], lr=1e-3)
    save_state(tmp_path / "optimizer.pt", opt.state_dict())
    opt2.load_state_dict(load_state(tmp_path / "optimizer.pt"))
    assert opt2.state[q]["absmax2"].dtype == torch.float32
    assert torch.equal(opt2.state[q]["absmax2"], opt.state[p]["absmax2"])
    q.grad = p.grad.clone()
    opt.step()
    opt2.step()
    assert torch.equal(p, q)
