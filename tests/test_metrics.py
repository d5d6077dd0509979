"""llmexp.metrics: the matmul ceiling behind MFU is only kept when the cores were the run's own."""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from llmexp.metrics import measure_ceiling


def test_a_ceiling_measured_beside_busy_processes_is_not_trusted() -> None:
    """Real competing processes (one busy loop per core) make the measured ceiling too low to keep."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(max(2, torch.get_num_threads()))]
    try:
        time.sleep(0.3)  # let them take the cores
        shared, trusted = measure_ceiling(torch.device("cpu"), torch.bfloat16)
    finally:
        for proc in burners:
            proc.kill()
            proc.wait()
    assert shared > 0
    assert not trusted
