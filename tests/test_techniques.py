"""Each training technique of the seed as one config choice, checked with real training steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from llmexp.train.schedule import lr_at
from llmexp.train.train import train
from tests.conftest import TINY, compose, read_metrics, run_cli, sft_file


def _train(overrides: list[str], run_dir: Path) -> dict:
    result = train(compose([*TINY, *overrides], run_dir))
    return result.summary


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def accumulation(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """The accumulation tests' settings (SFT records of very different lengths, unpacked, so micro-batches hold
    very different target-token counts) and their shared reference run: 8 examples a step, no accumulation."""
    tmp_path = tmp_path_factory.mktemp("accumulation")
    data = sft_file(tmp_path / "sft.jsonl")
    common = ["data=json", f"data.train_file={data}", "data.packing=false", "precision=fp32", "train.max_steps=8",
              "train.eval_steps=4", "train.save_steps=0", "lr=3e-3", "train.warmup_steps=3", "seed=1"]
    _train([*common, "batch_size=8", "train.gradient_accumulation_steps=1"], tmp_path / "big")
    return common, tmp_path / "big"


def test_accumulation_equals_the_big_batch_and_lr_follows_the_schedule(
        accumulation: tuple[list[str], Path], tmp_path: Path) -> None:
    common, big = accumulation
    small = tmp_path / "small"
    summary = _train([*common, "batch_size=2", "train.global_batch_size=8"], small)
    assert summary["gradient_accumulation_steps"] == 4 and summary["global_batch_size"] == 8
    losses_big = [r["loss"] for r in read_metrics(big, "train")]
    losses_small = [r["loss"] for r in read_metrics(small, "train")]
    assert len(losses_big) == 8
    assert losses_small == pytest.approx(losses_big, rel=1e-5)
    wb, ws = _weights(big), _weights(small)
    for name, tensor in wb.items():  # relative to each tensor's norm: Adam amplifies float noise in ~0 weights
        assert (ws[name] - tensor).norm() <= 1e-5 * tensor.norm(), name
    # The logged lr of step N is the lr that optimizer step N-1 (0-based) used.
    for record in read_metrics(big, "train"):
        expected = lr_at(record["step"] - 1, name="cosine", peak_lr=3e-3, max_steps=8, warmup_steps=3,
                         min_lr_ratio=0.1)
        assert record["lr"] == pytest.approx(expected, rel=1e-12)


ALIGNED = 1e-5
"""transformers' alignment check allows 0.01 between the runs' losses; llmexp's fp32 losses differ by float
reassociation only (4.8e-7 measured here), and the broken normalisation below moves them by 2e-4 to 8e-3,
which 0.01 would let through."""


def test_gradient_accumulation_loss_alignment_and_a_broken_normalisation_is_caught(
        accumulation: tuple[list[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' `test_gradient_accumulation_loss_alignment_with_model_loss` through llmexp: the train
    losses of 8 x 1 (batch x accumulation) and 4 x 2 agree, and the same check fails for a trainer that takes
    the mean of its micro-batches' mean losses (transformers' bug #34191), monkeypatched here only: each
    micro-batch's loss divided by its own target tokens, and the sum by the number of micro-batches instead of
    the global batch's target tokens; as transformers checks, that broken run still looks like training."""
    import llmexp.train.train as train_module
    from llmexp.model.loss import IGNORE_INDEX, CausalLMLoss

    common, big = accumulation
    base = [r["loss"] for r in read_metrics(big, "train")]

    def losses(name: str) -> list[float]:
        _train([*common, "batch_size=4", "train.gradient_accumulation_steps=2"], tmp_path / name)
        return [r["loss"] for r in read_metrics(tmp_path / name, "train")]

    def gap(other: list[float]) -> float:
        assert len(other) == len(base) == 8
        return max(abs(a - b) for a, b in zip(base, other, strict=True))

    accumulated = losses("accumulated")
    real_forward, real_forward_backward = CausalLMLoss.forward, train_module.forward_backward

    def micro_batch_mean(self: CausalLMLoss, input_ids: torch.Tensor, labels: torch.Tensor, **kw: Any) -> torch.Tensor:
        total = real_forward(self, input_ids, labels, **kw)
        if not torch.is_grad_enabled():  # evaluation keeps its per-token mean: only training is broken
            return total
        return total / (labels[:, 1:] != IGNORE_INDEX).sum().clamp(min=1)

    class MicroBatchCount:
        """The training set, except that a global batch counts one "target" per micro-batch."""

        def __init__(self, data: Any, micro_batches: int) -> None:
            self.data, self.micro_batches = data, micro_batches

        def num_targets(self, indices: Any) -> int:
            return self.micro_batches

        def __getattr__(self, name: str) -> Any:
            return getattr(self.data, name)

    def mean_of_means(run: Any, train_ds: Any) -> Any:
        return real_forward_backward(run, MicroBatchCount(train_ds, run.desc.plan.accum))

    monkeypatch.setattr(CausalLMLoss, "forward", micro_batch_mean)
    monkeypatch.setattr(train_module, "forward_backward", mean_of_means)
    broken = losses("broken")

    assert gap(accumulated) <= ALIGNED, (base, accumulated)
    assert gap(broken) > ALIGNED, (base, broken)  # the check catches it...
    assert abs(sum(broken) - sum(base)) / sum(base) < 0.01, (base, broken)  # ...where the curve looks fine


def test_fp16_overflow_skips_the_step_and_leaves_the_weights_unchanged(tmp_path: Path) -> None:
    from llmexp.model.build import build_model

    run_dir = tmp_path / "fp16"
    cfg = compose([*TINY, "precision=fp16", "precision.init_scale=1e38", "train.max_steps=2",
                   "train.eval_steps=100", "train.save_steps=0", "train.peak_tflops=1"], run_dir)  # no fp16 ceiling
    summary = train(cfg).summary
    torch.manual_seed(cfg.seed)
    initial = build_model(cfg, vocab_size=len(json.loads((run_dir / "model" / "tokenizer.json").read_text())
                                               ["model"]["vocab"]) + 0).state_dict()
    saved = _weights(run_dir)
    assert summary["skipped_steps"] == 2
    scales = [r["loss_scale"] for r in read_metrics(run_dir, "train")]
    assert scales == sorted(scales, reverse=True) and scales[-1] < 1e38
    for name, tensor in saved.items():
        assert torch.equal(tensor, initial[name]), name


@pytest.mark.parametrize(("optimizer", "lr"), [
    ("adamw", 3e-3), ("adamw8bit", 3e-3), ("paged_adamw8bit", 3e-3), ("lion", 1e-3), ("lion8bit", 1e-3),
    ("sgd", 0.3),
])
def test_each_optimizer_lowers_the_loss(optimizer: str, lr: float, tmp_path: Path) -> None:
    run_dir = tmp_path / optimizer
    _train([f"optimizer={optimizer}", f"lr={lr}", "train.max_steps=12", "train.eval_steps=100",
            "train.save_steps=0", "train.warmup_steps=0", "scheduler=constant"], run_dir)
    losses = [r["loss"] for r in read_metrics(run_dir, "train")]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.1, losses


def _state_bytes(optimizer_name: str, tmp_path: Path) -> tuple[int, set[torch.dtype]]:
    """Optimizer-state bytes after one step on the default tiny model (6.8M params)."""
    from llmexp.model.build import build_model, build_optimizer

    cfg = compose([f"optimizer={optimizer_name}", "train.weight_decay=0.01"], tmp_path / optimizer_name)
    model = build_model(cfg, 8192)
    opt = build_optimizer(cfg, model, 1e-3, "cpu")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    tensors = [v for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v) and v.numel() > 1]
    moments = [v for s in opt.state.values() for k, v in s.items() if k in ("state1", "state2") and v.numel() > 4096]
    return sum(t.numel() * t.element_size() for t in tensors), {t.dtype for t in moments}


def test_optimizer_state_sizes_match_the_seed(tmp_path: Path) -> None:
    adamw, _ = _state_bytes("adamw", tmp_path)
    eight, dtypes = _state_bytes("adamw8bit", tmp_path)
    lion, _ = _state_bytes("lion", tmp_path)
    assert dtypes == {torch.uint8}
    assert eight <= 0.27 * adamw, eight / adamw
    assert lion <= 0.51 * adamw, lion / adamw


def test_absurd_lr_stops_as_diverged_with_exit_code_3(tmp_path: Path) -> None:
    run_dir = tmp_path / "boom"
    proc = run_cli([*TINY, "lr=1000", "train.warmup_steps=0", "train.on_anomaly=stop", "train.max_steps=20",
                    "train.eval_steps=100", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 3, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["step"] <= 3
    assert any(f["severity"] == "error" for f in summary["findings"])


def test_global_batch_that_does_not_divide_exits_2(tmp_path: Path) -> None:
    proc = run_cli([*TINY, "batch_size=4", "train.global_batch_size=10", f"hydra.run.dir={tmp_path / 'r'}"])
    assert proc.returncode == 2
    assert "train.global_batch_size" in proc.stderr and "Traceback" not in proc.stderr


def test_a_global_batch_and_accumulation_that_disagree_exit_2_leaving_no_run_dir(tmp_path: Path) -> None:
    proc = run_cli([*TINY, "batch_size=4", "train.global_batch_size=64", "train.gradient_accumulation_steps=4",
                    f"hydra.run.dir={tmp_path / 'r'}"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "train.global_batch_size=64 and train.gradient_accumulation_steps=4 disagree" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_a_job_settles_the_compile_cache_before_torch_dynamo_can(tmp_path: Path) -> None:
    """A sweep job's process (no TORCHINDUCTOR_CACHE_DIR of its own) uses llmexp's cache, set before the trainer
    imports torch._dynamo; a user's own value wins. A fresh interpreter, since this one has imported torch."""
    script = ("import os, sys\n"
              "from llmexp.config.derived import use_shared_compile_cache\n"
              "from tests.conftest import compose\n"
              "from pathlib import Path\n"
              "cfg = compose([], Path(sys.argv[1]) / 'run')\n"
              "os.environ.pop('TORCHINDUCTOR_CACHE_DIR', None) if sys.argv[2] == 'unset' else None\n"
              "use_shared_compile_cache(cfg)\n"
              "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"  # torch's own answer
              "print(cache_dir())\n")
    env = {**os.environ, "LLMEXP_CACHE": str(tmp_path / "cache")}
    ours = subprocess.run([sys.executable, "-c", script, str(tmp_path), "unset"], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert ours == str(tmp_path / "cache" / "torchinductor")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "mine")
    theirs = subprocess.run([sys.executable, "-c", script, str(tmp_path), "keep"], env=env, capture_output=True,
                            text=True, check=True).stdout.strip()
    assert theirs == str(tmp_path / "mine")


@pytest.mark.slow
def test_compile_trains_and_reports_compile_time_apart(tmp_path: Path) -> None:
    eager = _train(["precision=fp32", "train.max_steps=4", "train.eval_steps=100", "train.save_steps=0"],
                   tmp_path / "eager")
    compiled = _train(["precision=fp32", "train.max_steps=4", "train.eval_steps=100", "train.save_steps=0",
                       "train.compile=true"], tmp_path / "compiled")
    assert compiled["status"] == "completed" and eager["compile_time_s"] == 0 and not eager["compile_time_by_graph_s"]
    by_graph = compiled["compile_time_by_graph_s"]  # the eval at step 0 compiles its own (no-grad) graph
    assert set(by_graph) == {"train", "eval"} and min(by_graph.values()) > 0
    assert compiled["compile_time_s"] == pytest.approx(sum(by_graph.values()))
    losses_eager = [r["loss"] for r in read_metrics(tmp_path / "eager", "train")]
    losses_compiled = [r["loss"] for r in read_metrics(tmp_path / "compiled", "train")]
    assert losses_compiled == pytest.approx(losses_eager, rel=1e-3)  # same math, other kernels


def test_compile_is_per_block_with_one_graph_and_no_mask_for_packed_batches() -> None:
    """Issue 41, item 5: `train.compile` compiles each decoder block (torchtitan's way), the model around them
    eager. A packed batch reaches the blocks with no materialised mask (SDPA's causal path), a block traces as one
    graph with no break, and the compiled model computes the eager model's loss."""
    from llmexp.train.setup import compile_blocks
    from tests.conftest import tiny_llama

    lm, seen = tiny_llama(), []
    block = lm.model.layers[0]
    hook = block.register_forward_pre_hook(lambda _, args, kwargs: seen.append((args, kwargs)), with_kwargs=True)
    ids = torch.randint(0, 512, (2, 32))
    eager = lm(input_ids=ids, labels=ids).loss
    hook.remove()
    args, kwargs = seen[0]
    assert kwargs.get("attention_mask") is None, "a packed batch got a materialised mask"
    explained = torch._dynamo.explain(block)(*args, **kwargs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    assert compile_blocks(lm) == len(lm.model.layers)
    assert lm(input_ids=ids, labels=ids).loss.item() == pytest.approx(eager.item(), rel=1e-4)
    assert all(name.startswith("model.") or name.startswith("lm_head.") for name in lm.state_dict())  # unrenamed


def test_compile_is_not_applied_under_the_bf16_emulation_and_no_time_is_set_aside(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch
                                                                                   ) -> None:
    """train.compile=true under llmexp's bf16 emulation (LLMEXP_BF16_EMULATION=1 turns it on, on any CPU): torch.compile
    traces nothing under the emulation's dispatch mode, so it is not applied, and no step or eval is compile time."""
    monkeypatch.setenv("LLMEXP_BF16_EMULATION", "1")
    summary = _train(["precision=bf16", "train.compile=true", "train.max_steps=2", "train.eval_steps=100",
                      "train.save_steps=0"], tmp_path / "run")
    (start,) = read_metrics(tmp_path / "run", "start")
    assert summary["status"] == "completed" and start["bf16_emulation"] is True
    assert summary["compile_time_s"] == 0 and summary["compile_time_by_graph_s"] == {}


def test_bf16_runs_emulated_on_a_cpu_without_native_bf16_and_says_so(tmp_path: Path) -> None:
    """`precision=bf16` where bf16 is emulated (LLMEXP_ASSUME_NO_BF16=1 simulates such a CPU: this one has
    AVX512-BF16) trains in bf16 autocast, measures torch's bf16 against fp32 at start-up, takes llmexp's emulation
    where it is faster, warns on the console with the measured factor and keeps the warning as a finding."""
    run_dir = tmp_path / "bf16"
    proc = run_cli([*TINY, "precision=bf16", "train.max_steps=3", "train.eval_steps=100", "train.save_steps=0",
                    f"hydra.run.dir={run_dir}"], env={"LLMEXP_ASSUME_NO_BF16": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[warning] step 0: precision=bf16 on a CPU without native bf16" in proc.stderr
    assert "precision=auto" in proc.stderr and "torch's bf16 matmuls measured" in proc.stderr
    (start,) = read_metrics(run_dir, "start")
    assert start["bf16_slowdown"] > 0 and ("so llmexp emulates bf16" in proc.stderr) == start["bf16_emulation"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["precision"] == "bf16"
    (finding,) = [f for f in summary["findings"] if f["kind"] == "bf16_emulated"]
    assert finding["severity"] == "warning" and "precision=auto" in finding["advice"]
    assert "`bf16_emulated`" in (run_dir / "report.md").read_text()


def test_auto_precision_is_fp32_without_native_bf16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMEXP_ASSUME_NO_BF16", "1")
    summary = _train(["precision=auto", "train.max_steps=2", "train.eval_steps=100", "train.save_steps=0"],
                     tmp_path / "auto")
    assert summary["precision"] == "fp32"
    assert not [f for f in summary["findings"] if f["kind"] == "bf16_emulated"]
