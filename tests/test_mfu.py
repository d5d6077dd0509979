"""MFU as the field counts it (issue 41, item 7): a known GPU's datasheet peak, the measured ceiling beside it;
LoRA's frozen weights at 4N FLOPs a token (no weight gradient), its trainable ones at 6N."""

from __future__ import annotations

import pytest
import torch

from llmexp.monitor import throughput
from llmexp.monitor.throughput import datasheet_peak, flops_per_token, mfu_peak


@pytest.mark.parametrize(("name", "card", "tflops"), [
    ("NVIDIA H200", "H200", 989), ("NVIDIA H100 80GB HBM3", "H100 SXM", 989), ("NVIDIA H100 PCIe", "H100 PCIe", 756),
    ("NVIDIA A100-SXM4-80GB", "A100", 312), ("NVIDIA A100 80GB PCIe", "A100", 312), ("NVIDIA L40S", "L40S", 362),
    ("NVIDIA L4", "L4", 121), ("NVIDIA A10", "A10", 125), ("NVIDIA GeForce RTX 4090", "RTX 4090", 165)])
def test_known_gpus_get_their_datasheet_dense_peak(name: str, card: str, tflops: float) -> None:
    assert datasheet_peak(name, torch.bfloat16) == (card, tflops) == datasheet_peak(name, torch.float16)


@pytest.mark.parametrize("name", ["NVIDIA H100 NVL", "NVIDIA A10G", "NVIDIA B200", "cpu"])
def test_unknown_cards_and_fp32_get_no_datasheet_peak(name: str) -> None:
    assert datasheet_peak(name, torch.bfloat16) is None
    assert datasheet_peak("NVIDIA H200", torch.float32) is None and datasheet_peak("NVIDIA H200", None) is None


def test_mfu_peak_is_the_datasheet_on_a_known_gpu_and_the_measured_ceiling_elsewhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert mfu_peak(torch.device("cpu"), torch.bfloat16, 1.5) == (
        1.5, {"peak_tflops_source": "measured matmul ceiling", "measured_tflops": 1.5})
    monkeypatch.setattr(throughput.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert mfu_peak(torch.device("cuda", 0), torch.bfloat16, 790.0) == (
        989.0, {"peak_tflops_source": "datasheet: H200, dense", "measured_tflops": 790.0})
    assert mfu_peak(torch.device("cuda", 0), None, 60.0)[0] == 60.0  # fp32: the measured ceiling


def test_lora_counts_4n_for_frozen_weights_and_6n_for_trainable() -> None:
    n, trainable, attention = 1_000_000, 10_000, 12.0 * 2 * 64 * 32
    assert flops_per_token(n, 2, 32, 64) == 6.0 * n + attention  # full fine-tuning as before
    assert flops_per_token(n, 2, 32, 64, trainable=n) == 6.0 * n + attention
    frozen = n - trainable
    assert flops_per_token(n, 2, 32, 64, trainable=trainable) == 4.0 * frozen + 6.0 * trainable + attention
    ratio = flops_per_token(n, 2, 32, 64) / flops_per_token(n, 2, 32, 64, trainable=0)
    assert ratio == pytest.approx(1.5, rel=1e-2)  # the 1.5x, attention aside


def test_process_age_is_within_the_wall_its_parent_measured() -> None:
    """A process's age (the start record's `process_s`, from which a run's import time is told) lies within the
    wall time around it: from psutil's create_time it read up to 1 s long (the boot time in whole seconds)."""
    import subprocess
    import sys
    import time

    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", "from llmexp.monitor.throughput import process_age_s; "
                          "print(process_age_s())"], capture_output=True, text=True, check=True).stdout
    wall_s = time.monotonic() - started
    assert 0 < float(out.split()[-1]) <= wall_s, (out, wall_s)
