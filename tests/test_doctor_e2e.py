"""End to end through the CLI: a real training run that blows up, then the doctor on its directory.
(The wandb sink fed by the real trainer is checked by tests/test_sinks.py's offline-fallback run.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY, run_cli


@pytest.mark.slow
def test_absurd_lr_is_diverged_and_the_doctor_says_why(tmp_path: Path) -> None:
    run_dir = tmp_path / "hot"
    proc = run_cli([*TINY, "lr=10", "train.on_anomaly=stop", "train.max_steps=10", "train.eval_steps=5",
                    "train.logging_steps=100",  # no train record before it diverges: its last line has no loss
                    "logger=tensorboard", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "diverged: " in proc.stderr and "=None" not in proc.stderr  # the last line shows only what it has
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged"
    assert any(f["severity"] == "error" for f in summary["findings"]), summary["findings"]

    (run_dir / "report.md").unlink()
    doctor = run_cli([str(run_dir)], module="llmexp.doctor", timeout_s=120)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert "ERROR   divergence at step" in doctor.stdout and "lr=auto" in doctor.stdout
    report = (run_dir / "report.md").read_text()
    assert "**Status:** diverged" in report and "`divergence`" in report and "| lr | 10 |" in report
    assert (run_dir / "curves.png").stat().st_size > 10_000

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert events.Scalars("eval/eval_loss")[0].step == 0  # the trainer fed the sink
