"""The README's headline commands, typed as a new user types them, in a fresh working directory.

    python -m llmexp optimizer=adamw8bit precision=bf16
    python -m llmexp --multirun lr=1e-5,3e-5,5e-5 batch_size=2,4
    python -m llmexp --multirun cluster=slurm lr=1e-5,3e-5,5e-5

Each runs with the same arguments plus only size overrides: `train.max_steps=` and the tests' tiny model
and data (`SMALL`). What these tests check is the path (the optimizer class, the precision and its warning,
every job of the grid on each launcher), which the model's size does not change; the default model costs
minutes here for nothing (on a CPU without AVX512, bf16 at the default size took 578 s for 10 steps).
`benchmarks/first_run.py` times the whole default run, and the GPU kit (`benchmarks/gpu/run.sh`) runs the
commands exactly as written. The first runs on a CPU without native bf16 (simulated with
LLMEXP_ASSUME_NO_BF16=1 where the CPU has AVX512-BF16): the case that once exited 2. The SLURM sweep also
gets test_slurm.py's markers and environment (one thread per job, the repository on PYTHONPATH for Hydra's
plugin scan).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY, read_metrics, run_cli, slurm_reachable

NO_BF16 = {"LLMEXP_ASSUME_NO_BF16": "1", "LLMEXP_BF16_EMULATION": "1", "CUDA_VISIBLE_DEVICES": ""}
"""A CPU without native bf16, on which llmexp emulates bf16 (forced: on a CPU with AVX512-BF16 the start-up probe
finds torch's own bf16 faster and would not emulate)."""
SMALL = [o for o in TINY if not o.startswith(("batch_size=", "train.logging_steps="))]
"""The tiny test model and data; the headline's own batch sizes and logging stay as the user gets them."""


def only(pattern: str, root: Path) -> Path:
    """The one path under `root` matching `pattern` (a run or sweep directory the command created)."""
    (found,) = sorted(root.glob(pattern))
    return found


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_adamw8bit_bf16_headline_runs_on_a_cpu_without_native_bf16(tmp_path: Path) -> None:
    proc = run_cli(["optimizer=adamw8bit", "precision=bf16", "train.max_steps=10", *SMALL], cwd=tmp_path,
                   env=NO_BF16, timeout_s=2300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = only("outputs/*/*", tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["precision"] == "bf16" and summary["step"] == 10
    (finding,) = [f for f in summary["findings"] if f["kind"] == "bf16_emulated"]
    assert finding["severity"] == "warning" and "precision=auto" in finding["advice"]
    assert "precision=bf16 on a CPU without native bf16" in proc.stderr  # printed, not only recorded
    assert "so llmexp emulates bf16" in finding["message"] and "emulated by llmexp on fp32 matmuls" in proc.stderr
    (start,) = [r for r in read_metrics(run_dir, "start")]
    assert start["bf16_emulation"] is True and start["bf16_slowdown"] > 0
    assert "`bf16_emulated`" in (run_dir / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_local_sweep_headline_runs_every_job(tmp_path: Path) -> None:
    proc = run_cli(["--multirun", "lr=1e-5,3e-5,5e-5", "batch_size=2,4", "train.max_steps=3", *SMALL],
                   cwd=tmp_path, timeout_s=2300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    sweep = json.loads((only("multirun/*/*", tmp_path) / "sweep_summary.json").read_text())
    assert [j["status"] for j in sweep["jobs"]] == ["completed"] * 6
    grid = {(float(j["params"]["lr"]), int(j["params"]["batch_size"])) for j in sweep["jobs"]}
    assert grid == {(lr, b) for lr in (1e-5, 3e-5, 5e-5) for b in (2, 4)}
    # On CPU each job is forked from the sweep's preloaded interpreter (llmexp.sweep.local `_WarmJob`), a process
    # of its own all the same: six pids
    started = [line for line in proc.stdout.splitlines() if " started (pid " in line]
    assert len(started) == 6 and all(", CPU, warm): " in line for line in started), started
    assert len({line.split("(pid ", 1)[1].split(",")[0] for line in started}) == 6


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(2400)
def test_slurm_sweep_headline_runs_every_job(tmp_path: Path) -> None:
    from tests.test_slurm import ENV

    if not slurm_reachable():
        pytest.skip("no SLURM cluster: run `sudo bash launch/slurm-local.sh up` (make test does)")
    proc = run_cli(["--multirun", "cluster=slurm", "lr=1e-5,3e-5,5e-5", "train.max_steps=3", *SMALL],
                   cwd=tmp_path, env=ENV, timeout_s=2300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweep = json.loads((only("multirun/*/*", tmp_path) / "sweep_summary.json").read_text())
    assert [j["status"] for j in sweep["jobs"]] == ["completed"] * 3
    assert [float(j["params"]["lr"]) for j in sweep["jobs"]] == [1e-5, 3e-5, 5e-5]
