"""The console (llmexp.monitor.console, the logger's ETA line): the first screen describes the model, and
third-party warnings stay out of the console."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import pytest

from llmexp.monitor.console import format_header, format_size, held_warnings_note, quiet_console
from llmexp.monitor.logger import MetricsLogger

START = {"event": "start", "step": 0, "run_dir": "/runs/r", "model": "tiny", "precision": "fp32",
         "precision_requested": "fp32", "max_steps": 10, "batch_size": 4, "world_size": 1,
         "gradient_accumulation_steps": 1, "global_batch_size": 4, "max_length": 128, "optimizer": "adamw",
         "scheduler": "constant", "lr_chosen": 2e-4, "lr_source": "auto-adapter", "data": "json"}


def test_the_header_names_a_fine_tuned_model_its_size_and_its_adapters() -> None:
    record = {**START, "model_path": "/models/smollm2", "model_id": "/models/smollm2",
              "architecture": "LlamaForCausalLM", "model_params": 134_515_008, "trainable_params": 4_884_480,
              "adapter": {"method": "lora", "r": 16, "modules": 210}, "vocab_size": 49_152,
              "context_length": 8_192,
              "cpu_matmul": {"path": "onednn", "reason": "2.10x torch's speed on a 512 x 576 x 1536 matmul here"}}
    head = format_header(record).splitlines()
    assert head[1] == "model      /models/smollm2: LlamaForCausalLM, fine-tuning"
    assert head[2] == ("           134.5M parameters, 4.9M trainable (3.6%, LoRA r=16 on 210 modules); "
                       "vocabulary 49,152, context 8,192")
    assert "precision  fp32 (precision=fp32); matmuls through oneDNN: 2.10x torch's speed" in format_header(record)
    assert "lr=auto with adapters" in format_header(record)


def test_the_header_of_a_model_from_scratch_and_of_a_gguf_file() -> None:
    scratch = {**START, "architecture": "LlamaForCausalLM", "model_id": "tiny", "model_params": 6_850_000,
               "trainable_params": 6_850_000, "vocab_size": 8192, "context_length": 256, "lr_source": "data",
               "data": "stdlib", "cpu_matmul": {"path": "torch", "reason": "train.cpu_matmul=torch"}}
    text = format_header(scratch)
    assert "model      tiny: LlamaForCausalLM, from scratch\n           6.8M parameters; vocabulary 8,192" in text
    assert "matmuls through torch: train.cpu_matmul=torch" in text
    assert "lr=auto: data=stdlib's lr for training from scratch" in text
    gguf = {**scratch, "model_path": "/m", "model_id": "/m/x.Q4_K_M.gguf", "gguf_dtype": "fp32",
            "lr_source": "auto"}
    text = format_header(gguf)
    assert "model      /m/x.Q4_K_M.gguf: LlamaForCausalLM, from GGUF dequantised to fp32, fine-tuning" in text
    assert "lr=auto: by model size, / 10 to fine-tune" in text


def test_an_old_start_record_still_prints() -> None:
    """metrics.jsonl of runs before the model facts existed (llmexp.report reads old directories too)."""
    assert "model      tiny (from scratch), 4.9M parameters" in format_header({**START, "num_params": 4_884_480})


@pytest.mark.parametrize(("n", "text"), [(134_515_008, "134.5M"), (4_884_480, "4.9M"), (123_200, "123.2K"),
                                         (6_738_415_616, "6.74B")])
def test_sizes_read_at_a_glance(n: int, text: str) -> None:
    assert format_size(n) == text


def test_the_header_says_when_train_records_were_dropped() -> None:
    """20 of 38 SFT records whose prompt filled data.max_length went without a word (only the start record had it)."""
    from llmexp.data.datasets import cut_examples

    ids = [np.arange(100), np.arange(10)]
    masks = [np.r_[np.zeros(95, bool), np.ones(5, bool)], np.r_[np.zeros(5, bool), np.ones(5, bool)]]
    _, stats = cut_examples("padded", ids, masks, max_length=64, keep_tail=False)
    assert (stats["truncated_tokens"], stats["dropped_examples"], stats["dropped_tokens"]) == (36, 1, 64)
    head = format_header({**START, "data_train_records": 2, "data_train_dropped_examples": 1})
    assert "warning: 1 of 2 train records dropped, no completion token left within data.max_length" in head
    assert "dropped" not in format_header({**START, "data_train_records": 2, "data_train_dropped_examples": 0})


@pytest.mark.parametrize(("max_steps", "said"), [(4, None), (6, "eta 0s for the 2 remaining steps")])
def test_the_eta_line_comes_only_while_steps_remain(max_steps: int, said: str | None, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LLMEXP_NO_BAR", "1")
    log = MetricsLogger(tmp_path, max_steps, enabled=True)
    for step in range(1, 5):
        log.advance()
        log.log({"event": "train", "step": step, "loss": 1.0, "ppl": 2.7, "lr": 1e-3, "grad_norm": 1.0,
                 "tokens_per_sec": 10.0, "mfu": None})
    log.close()
    err = capsys.readouterr().err
    if said is None:  # the 4th step is the last: no "eta 0s for the 0 remaining steps" before its line
        assert "eta" not in err, err
    else:
        assert said in err, err


def test_the_eta_after_a_resume_counts_from_the_checkpoints_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint at step 6 whose history logged nothing after step 3 (train.logging_steps=10): the eta counted
    from step 3 ("the 23 remaining steps" of 30 after step 10)."""
    monkeypatch.setenv("LLMEXP_NO_BAR", "1")
    log = MetricsLogger(tmp_path, 30, enabled=True)
    log.reset_history([{"event": "eval", "step": 3, "eval_loss": 6.0}], steps_done=6)
    for _ in range(4):
        log.advance()
    log.close()
    assert "for the 20 remaining steps" in capsys.readouterr().err


def test_third_party_warnings_go_to_the_log_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    console, file = logging.StreamHandler(), logging.FileHandler(tmp_path / "llmexp.log")
    root.addHandler(console)
    root.addHandler(file)
    try:
        quiet_console()
        # Loggers no library configures: an earlier in-process run's logging config may have disabled real ones
        # (bitsandbytes', once imported), and torch's does not propagate.
        logging.getLogger("a_library.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("is_gradient_checkpointing is deprecated", FutureWarning, stacklevel=1)
        logging.getLogger("llmexp.console").warning("llmexp's own line")
        logging.getLogger("some_library").error("a third-party error")
        note = held_warnings_note()
    finally:
        root.removeHandler(console)
        root.removeHandler(file)
        file.close()
        logging.captureWarnings(False)
    err = capsys.readouterr().err
    assert "gemm_4bit" not in err and "deprecated" not in err
    assert "llmexp's own line" in err and "a third-party error" in err
    log = (tmp_path / "llmexp.log").read_text()
    assert "gemm_4bit" in log and "is_gradient_checkpointing is deprecated" in log
    assert note == ("note: 2 third-party warnings went to llmexp.log only "
                    "(from a_library.backends.cpu.ops, py.warnings)")


def test_warnings_reach_the_log_after_a_catch_warnings_block_put_the_original_back(tmp_path: Path) -> None:
    """An in-process caller runs several runs; a `warnings.catch_warnings` block between them (pytest wraps every
    test in one) restores Python's own showwarning, which captureWarnings(True) alone would not replace again."""
    file = logging.FileHandler(tmp_path / "llmexp.log")
    logging.getLogger().addHandler(file)
    try:
        with warnings.catch_warnings(record=True):
            quiet_console()  # the first run
        quiet_console()  # the next one
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a deprecation from a library", FutureWarning, stacklevel=1)
    finally:
        logging.getLogger().removeHandler(file)
        file.close()
        logging.captureWarnings(False)
    assert "a deprecation from a library" in (tmp_path / "llmexp.log").read_text()
