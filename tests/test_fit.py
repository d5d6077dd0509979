"""`python -m llmexp.fit`: the math on synthetic points, the command on hand-made sweep directories (a known law
recovered, bad input refused with exit 2), and on a real tiny sweep."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from llmexp.cli.fit import main as fit_main
from llmexp.report.fit import grid_step, power_law, vertex
from tests.conftest import TINY, run_cli

LRS = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2]


def logs(values: list[float]) -> list[float]:
    return [math.log(v) for v in values]


def bowl(lr: float, best: float, depth: float = 3.0, width: float = 0.05) -> float:
    """A loss that is a parabola in log(lr) with its minimum at `best`."""
    return depth + width * (math.log(lr) - math.log(best)) ** 2


# ----------------------------------------------------------------------------- the math

def test_vertex_of_a_known_parabola_is_recovered() -> None:
    v = vertex(logs(LRS), [bowl(lr, 2e-3) for lr in LRS])
    assert v.edge is None and math.exp(v.x_best) == pytest.approx(2e-3, rel=1e-6)
    assert [LRS[i] for i in v.window] == [1e-3, 3e-3, 1e-2]  # the minimum's neighbours; the rest are further away
    fine = [1e-3 * 2 ** (k / 2) for k in range(9)]  # a sqrt(2) grid: every point within half a decade of the minimum
    v = vertex(logs(fine), [bowl(lr, 3e-3) for lr in fine])
    assert [round(fine[i], 6) for i in v.window] == [round(lr, 6) for lr in fine[:7]]  # seven, 1e-3 to 8e-3


def test_noisy_vertex_has_an_interval_around_the_truth() -> None:
    rng = np.random.default_rng(0)
    grid = list(np.geomspace(1e-4, 1e-1, 13))
    v = vertex(logs(grid), [bowl(lr, 3e-3) + rng.normal(0, 0.004) for lr in grid])
    lo, hi = (math.exp(x) for x in v.interval)
    assert lo < 3e-3 < hi and hi / lo < 3 and v.sigma_source == "fit residuals"
    assert lo <= math.exp(v.x_best) <= hi


def test_replicate_seeds_give_the_noise_even_at_three_points() -> None:
    lrs = [1e-3, 3e-3, 1e-2]
    reps = [[bowl(lr, 3e-3) + d for d in (-0.01, 0.01)] for lr in lrs]
    v = vertex(logs(lrs), [float(np.mean(r)) for r in reps], runs=[2, 2, 2], replicates=reps)
    assert v.sigma_source == "replicate seeds" and v.interval is not None
    # three points without seeds fit exactly: no noise to speak of, no interval
    assert vertex(logs(lrs), [bowl(lr, 3e-3) for lr in lrs]).interval is None


@pytest.mark.parametrize(("best", "edge"), [(1e-5, "low"), (1.0, "high")])
def test_minimum_at_the_grids_edge_has_no_vertex(best: float, edge: str) -> None:
    v = vertex(logs(LRS), [bowl(lr, best) for lr in LRS])
    assert v.edge == edge and v.x_best is None and v.coef is None


def test_a_vertex_past_the_fitted_points_is_an_edge() -> None:
    """A skewed curve whose grid minimum is inside but whose parabola bottoms out below the lowest lr (measured by
    benchmarks/transfer.py at width 256, 60 steps): no vertex is claimed, the grid is flagged to extend down."""
    v = vertex(logs([1e-3 * 2 ** (k / 2) for k in range(4)]), [6.743, 6.722, 6.920, 6.974])  # (a sqrt(2) grid)
    assert v.x_best is None and v.interval is None and v.edge == "low"


def test_power_law_exponent_is_recovered_with_an_interval() -> None:
    rng = np.random.default_rng(1)
    ns = [1e6, 4e6, 1.6e7, 6.4e7, 2.6e8]
    law = power_law(logs(ns), [math.log(0.05 * n ** -0.3) + rng.normal(0, 0.05) for n in ns])
    assert law.b == pytest.approx(-0.3, abs=0.05) and law.b_interval[0] < -0.3 < law.b_interval[1]
    value, interval = law.at(1e9)
    assert interval[0] < value < interval[1] and value == pytest.approx(0.05 * 1e9 ** -0.3, rel=0.3)
    exact = power_law(logs(ns[:2]), [math.log(0.05 * n ** -0.3) for n in ns[:2]])
    assert exact.b == pytest.approx(-0.3) and exact.b_interval is None  # 2 points, no draws: nothing to go by


def test_two_sizes_take_their_interval_from_the_vertices_draws() -> None:
    draws = [np.random.default_rng(i).normal(math.log(lr), 0.1, 2000) for i, lr in enumerate((3e-3, 1e-3))]
    law = power_law(logs([1e6, 1e8]), logs([3e-3, 1e-3]), draws)
    assert law.interval_method == "bootstrap of the vertices" and law.b_interval[0] < law.b < law.b_interval[1]
    assert law.at(1e9)[1] is not None


def test_grid_step_is_the_grids_resolution() -> None:
    assert grid_step([1e-3, 3e-3, 1e-2, 3e-3]) == pytest.approx(3.2, rel=0.1)


# ----------------------------------------------------------------------------- hand-made sweeps

def make_job(job_dir: Path, params: int, lr: float, loss: float | None, batch: int = 8, status: str = "completed",
             parametrization: str | None = None) -> Path:
    """The files a finished job leaves that the fit reads: summary.json, the start record, .hydra/."""
    (job_dir / ".hydra").mkdir(parents=True)
    model = {"name": "tiny", "hidden_size": 64} | ({"parametrization": parametrization} if parametrization else {})
    (job_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"lr": lr, "model": model}))
    (job_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"lr={lr}", f"batch_size={batch}"]))
    start = {"event": "start", "step": 0, "model_params": params, "max_length": 64, "lr_chosen": lr}
    (job_dir / "metrics.jsonl").write_text(json.dumps(start) + "\n")
    summary = {"status": status, "step": 100, "eval_loss": loss if loss is not None else float("nan"), "lr": lr,
               "global_batch_size": batch, "total_params": params, "findings": []}
    (job_dir / "summary.json").write_text(json.dumps(summary))
    return job_dir


def make_sweep(root: Path, sizes: dict[int, float], lrs: list[float] = LRS, batches: tuple[int, ...] = (8,),
               parametrization: str | None = None, start: int = 0) -> Path:
    """A grid over size x lr (x batch): losses are bowls in log(lr) around `sizes[params]`, the best batch 16."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    job = start
    for params, best in sizes.items():
        for batch in batches:
            for lr in lrs:
                loss = bowl(lr, best, depth=4.0 - 0.1 * math.log10(params)) + 0.02 * math.log2(batch / 16) ** 2
                make_job(root / str(job), params, lr, loss, batch, parametrization=parametrization)
                job += 1
    return root


LAW = {1_000_000: 0.02 * 1e6 ** -0.25, 4_000_000: 0.02 * 4e6 ** -0.25, 16_000_000: 0.02 * 1.6e7 ** -0.25}


def fit(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = fit_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_known_law_is_recovered_from_sweep_dirs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # two sweeps, one size in the second: the fit reads them as one grid
    first = make_sweep(tmp_path / "a", dict(list(LAW.items())[:2]))
    second = make_sweep(tmp_path / "b", dict(list(LAW.items())[2:]))
    rc, out, _ = fit([first, second, "--target-params", "1B", "--out", tmp_path / "fit"], capsys)
    assert rc == 0, out
    result = json.loads((tmp_path / "fit" / "fit.json").read_text())
    assert (tmp_path / "fit" / "fit.png").stat().st_size > 10_000
    assert set(result) >= {"sweep_dirs", "sizes", "lr_law", "batch_law", "target", "mup", "deepseek_llm", "left_out"}
    for size in result["sizes"]:
        assert size["best_lr"] == pytest.approx(LAW[size["params"]], rel=1e-6) and size["edge"] is None
        assert size["seed_table_lr"] == 3e-4 and size["deepseek"]["compute"] == 6 * size["params"] * 100 * 8 * 64
    assert result["lr_law"]["b"] == pytest.approx(-0.25, abs=1e-6)
    assert result["target"]["lr"] == pytest.approx(0.02 * 1e9 ** -0.25, rel=1e-4)
    assert "lr law: best_lr = 0.02 * N^-0.250" in out and "at N = 1B: lr" in out and "fit.json" in out


def test_edge_flag_and_the_law_without_that_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = make_sweep(tmp_path / "s", {**LAW, 64_000_000: 1e-5})  # its best lr below the grid
    rc, out, _ = fit([sweep], capsys)
    assert rc == 0
    result = json.loads((sweep / "fit.json").read_text())
    edge = result["sizes"][-1]
    assert edge["edge"] == "low" and edge["best_lr"] is None and "extend it down" in edge["advice"]
    assert "lr grid too narrow, extend it down" in out and result["lr_law"]["sizes"] == 3


def test_diverged_lr_above_the_best_says_where_to_add_lrs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = make_sweep(tmp_path / "s", {1_000_000: 1.0}, lrs=LRS[:4])
    make_job(sweep / "9", 1_000_000, 1e-2, None, status="diverged")
    assert fit([sweep], capsys)[0] == 0
    size = json.loads((sweep / "fit.json").read_text())["sizes"][0]
    assert size["diverged_lrs"] == [1e-2] and "between 0.003 and 0.01, which diverged" in size["advice"]


def test_batch_size_swept_gives_a_best_batch_per_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = make_sweep(tmp_path / "s", LAW, lrs=LRS[1:5], batches=(4, 8, 16, 32, 64))
    rc, out, _ = fit([sweep], capsys)
    assert rc == 0, out
    result = json.loads((sweep / "fit.json").read_text())
    for size in result["sizes"]:
        assert size["batch"]["best_batch"] == pytest.approx(16, rel=1e-6) and size["batch_size"] == 16
    assert result["batch_law"]["fitted"] and result["batch_law"]["b"] == pytest.approx(0, abs=1e-6)


def test_mup_reports_how_far_the_optimum_moved(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = make_sweep(tmp_path / "s", {1_000_000: 3e-3, 4_000_000: 3.5e-3, 16_000_000: 2.8e-3},
                       parametrization="mup")
    rc, out, _ = fit([sweep, "--target-params", "7B"], capsys)
    assert rc == 0
    result = json.loads((sweep / "fit.json").read_text())
    assert result["mup"]["flat"] and result["mup"]["moved_by"] == pytest.approx(3.5 / 2.8, rel=1e-3)
    assert not result["lr_law"]["fitted"] and "muP transfer" in result["target"]["from"]
    assert re.search(r"muP: the best lr moved by a factor 1\.[23] across 3 sizes; within one grid step", out), out


@pytest.mark.parametrize(("sizes", "advice"), [({1_000_000: 3e-3}, "sweep a second width to see whether it moves"),
                                               ({1_000_000: 3e-3, 4_000_000: 1e-1}, "fix the edge flags above")])
def test_mup_with_one_best_lr_carries_it_and_says_what_would_compare(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], sizes: dict[int, float], advice: str) -> None:
    """One proxy size is the usual muP workflow: its best lr is the target's, and the advice names what a second
    size would add (or, where a size's best lay at the grid's edge, the flag to fix)."""
    rc, out, _ = fit([make_sweep(tmp_path / "s", sizes, parametrization="mup"), "--target-params", "42M"], capsys)
    assert rc == 0
    assert f"1 size(s) with a best lr: nothing to compare ({advice})" in out, out
    target = re.search(r"at N = 42M: lr (\S+) (.*)", out)
    assert target and float(target.group(1)) == pytest.approx(3e-3, rel=0.05), out
    result = json.loads((tmp_path / "s" / "fit.json").read_text())  # the one size's interval is the target's
    assert result["target"]["interval"] == result["sizes"][0]["interval"]
    assert "3 points fit exactly" not in target.group(2), out  # (said of a target that no 3 points gave)


def test_a_sweep_given_twice_counts_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its jobs counted twice, as replicate seeds with no spread: the intervals vanished."""
    sweep = make_sweep(tmp_path / "s", {1_000_000: 3e-3}, lrs=[1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2])
    assert fit([sweep], capsys)[0] == 0
    once = json.loads((sweep / "fit.json").read_text())["sizes"]
    assert fit([sweep, sweep], capsys)[0] == 0
    assert json.loads((sweep / "fit.json").read_text())["sizes"] == once


# ----------------------------------------------------------------------------- bad input


def bad(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each bad input, and what its message must say."""
    plain = tmp_path / "plain"
    plain.mkdir()
    unfinished = make_sweep(tmp_path / "unfinished", {1_000_000: 1e-3})
    for job in unfinished.iterdir():
        if job.is_dir():
            (job / "summary.json").unlink()
    two = make_sweep(tmp_path / "two", {1_000_000: 1e-3}, lrs=[1e-3, 3e-3])
    killed = make_sweep(tmp_path / "killed", {1_000_000: 1e-3}, lrs=[1e-3, 3e-3, 1e-2])
    (killed / "1" / "summary.json").unlink()  # its process was killed: the sweep did not finish
    damaged = make_sweep(tmp_path / "damaged", {1_000_000: 1e-3})
    (damaged / "2" / "summary.json").write_text('{"status": "compl')
    diverged = make_sweep(tmp_path / "diverged", {1_000_000: 1e-3}, lrs=[])
    for i, lr in enumerate((1e-2, 3e-2, 1e-1)):
        make_job(diverged / str(i), 1_000_000, lr, None, status="diverged")
    mixed = make_sweep(tmp_path / "mixed", {1_000_000: 1e-3})
    make_sweep(mixed, {4_000_000: 1e-3}, parametrization="mup", start=10)
    bases = make_sweep(tmp_path / "bases", {1_000_000: 1e-3}, parametrization="mup")
    make_sweep(bases, {4_000_000: 1e-3}, parametrization="mup", start=10)
    for config in (bases / str(job) / ".hydra" / "config.yaml" for job in range(10, 10 + len(LRS))):
        config.write_text(config.read_text().replace("name: tiny", "mup_base_width: 32\n  name: tiny"))
    return {"not a sweep": (plain, "is not a sweep directory"),
            "unfinished": (unfinished, "no finished job with an eval loss"),
            "two lrs": (two, "2 lr(s) with an eval loss (0.001, 0.003); a parabola needs at least 3"),
            "one killed": (killed, f"1 job(s) were left out, e.g. {killed / '1'}: no summary.json (running, killed or "
                                   "crashed); a sweep that has not finished continues with its own command"),
            "damaged": (damaged, f"{damaged / '2' / 'summary.json'}: damaged"),
            "all diverged": (diverged, "diverged: sweep lower lrs (the lowest here, 0.01, is still too high)"),
            "mixed": (mixed, "mix model.parametrization=mup and standard"),
            "muP bases": (bases, "the muP jobs mix base models (model.mup_base_width=32 ")}


def test_bad_input_exits_2_naming_the_dir_and_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, (sweep, message) in bad(tmp_path).items():
        rc, _, err = fit([sweep], capsys)
        assert rc == 2 and message in err and "Traceback" not in err, (name, err)
        assert not (sweep / "fit.json").exists() and not (sweep / "fit.png").exists(), name


# ----------------------------------------------------------------------------- a real sweep

STEPS = 4


@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """lr x hidden size, 3 x 2, a few steps each: the files a real sweep leaves."""
    sweep = tmp_path_factory.mktemp("fit") / "sweep"
    tiny = [o for o in TINY if not o.startswith("model.hidden_size=")]
    # two jobs at a time: each is mostly its process starting (imports), one thread each
    proc = run_cli(["--multirun", *tiny, "cluster.max_parallel=2", "lr=1e-3,3e-3,1e-2", "model.hidden_size=64,128",
                    "precision=fp32", f"train.max_steps={STEPS}", f"train.eval_steps={STEPS}", "train.save_steps=0",
                    "train.warmup_steps=1", f"hydra.sweep.dir={sweep}"], env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep


def test_fit_of_a_real_sweep(real_sweep: Path, tmp_path: Path) -> None:
    proc = run_cli([str(real_sweep), "--target-params", "1e9", "--out", str(tmp_path)], module="llmexp.fit")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "fit.json").read_text())
    assert (tmp_path / "fit.png").stat().st_size > 10_000
    assert {"sizes", "lr_law", "target", "deepseek_llm"} <= set(result) and len(result["sizes"]) == 2
    assert [len(s["points"]) for s in result["sizes"]] == [3, 3]
    assert result["sizes"][0]["params"] < result["sizes"][1]["params"]
    assert all(s["tokens_seen"] == STEPS * 4 * 64 for s in result["sizes"])
    assert "best lr [95% interval]" in proc.stdout and str(tmp_path / "fit.json") in proc.stdout
    assert "torch" not in proc.stderr


def test_bad_input_from_the_command_line(tmp_path: Path) -> None:
    proc = run_cli([str(tmp_path)], module="llmexp.fit")
    assert proc.returncode == 2 and "is not a sweep directory" in proc.stderr and "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "fit.json")


def test_the_fit_never_imports_torch(tmp_path: Path) -> None:
    sweep = make_sweep(tmp_path / "s", LAW)
    code = (f"import sys; from llmexp.cli.fit import main; rc = main([{str(sweep)!r}]); "
            "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_an_interval_to_one_side_of_its_vertex_is_drawn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A noisy size's bootstrap interval can miss its vertex (benchmarks/transfer.py met one): the picture is still
    drawn, the bar stopping at the vertex (was matplotlib's "'yerr' must not contain negative values")."""
    from llmexp.report.fit_plot import plot_fit

    rc, _, _ = fit([make_sweep(tmp_path / "a", dict(list(LAW.items())[:2])), "--out", tmp_path / "fit"], capsys)
    result = json.loads((tmp_path / "fit" / "fit.json").read_text())
    best = result["sizes"][0]["best_lr"]
    result["sizes"][0]["interval"] = [best * 1.2, best * 1.5]
    plot_fit(result, tmp_path / "one-sided.png", None)
    assert rc == 0 and (tmp_path / "one-sided.png").stat().st_size > 10_000


def test_out_that_is_a_file_and_an_unreadable_count_are_named(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    sweep = make_sweep(tmp_path / "s", dict(list(LAW.items())[:2]))
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out in (afile, afile / "fit"):  # (below a file, mkdir said only "[Errno 20] Not a directory")
        rc, _, err = fit([sweep, "--out", out], capsys)
        assert rc == 2 and f"--out={out}: " in err and "is a file" in err and "Errno" not in err
    assert afile.read_text() == "x"
    rc, _, err = fit([sweep, "--out", "/proc/llmexp-fit"], capsys)  # a directory the kernel will not create
    assert rc == 2 and "--out /proc/llmexp-fit: cannot write there (" in err and "pick another --out" in err, err
    with pytest.raises(SystemExit) as exit_info:
        fit([sweep, "--target-params", "abc"], capsys)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "'abc' is not a parameter count" in err and "7B" in err
    assert "parse_count" not in err
