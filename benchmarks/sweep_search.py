"""A search against a grid on the tiny model's lr landscape (issue #17): does `sweep=tpe sweep.pruner=asha`
find the grid's best eval loss while training a fraction of the grid's steps?

    python benchmarks/sweep_search.py            # the measurement: 16 min on a 2-core CPU (shared, load 3-5)
    python benchmarks/sweep_search.py --quick    # a smoke run (a 2-layer 64-wide model, 20 steps): ~2 min,
                                                 # prints the facts as JSON, writes no result file

Everything runs through the real CLI, in fresh processes, as a user would type it:
1. The landscape: `python -m llmexp --multirun lr=<12 points log-spaced over [1e-5, 1e-1]>`, 200 steps each.
2. The search, once per sweep seed 0, 1, 2: `python -m llmexp --multirun sweep=tpe sweep.pruner=asha
   sweep.n_trials=12 sweep.parallel=1 sweep.seed=S 'lr=tag(log,interval(1e-5,1e-1))'`, 200 steps a trial.
Both use the same model, data, training seed and settings, so a grid point and a trial at the same lr train
alike. Each sweep directory is read back with llmexp's own sweep report (`llmexp.report.sweep`).

Targets, on the medians over the 3 seeds: the search's best final eval loss is within 2% of the grid's best
point (ratio <= 1.02), and the search trained at most 40% of the steps the grid trained (ratio <= 0.40).

Settings, and why:
- `model=tiny` (hidden 256, 4 layers, vocab 8192), fp32, `batch_size=4`, `data.max_length=32` (not 256): an
  eighth of the tokens a step, so that 12 grid points and 3 searches (~50 processes, ~5,000 steps) fit ~25
  minutes on a 2-core CPU shared with other work. Only the landscape's shape over lr matters here, and both
  sides train exactly alike.
- `train.eval_steps=20`: the sweeper's ASHA is optuna's SuccessiveHalvingPruner with min_resource =
  train.eval_steps and reduction factor 3, so its rungs are at steps 20, 60 and 180: a trial stopped at the
  first rung costs a tenth of a grid point. Fewer, later evals (50) would put the first rung at a quarter.
- `sweep.n_trials=12`, as many trials as grid points: the saving must come from pruning, not from a smaller
  budget of trials. ASHA promotes a trial past a rung only when it is in the best third there (the first few
  trials at a rung, with no rivals yet, go on), so about a third of the trials pass 20 steps and a ninth
  reach 200: roughly 12 x 20 + 4 x 40 + 2 x 120 + 1-2 x 20 ~ 700 steps of the grid's 2,400 (~30%; measured 22-30%).
- `train.eval_batches=4` (the same 16 held-out sequences for every run), `train.save_steps=0`.
- The grid and the seeds run `--concurrency` (2) at a time, each on cores/concurrency threads; a search's
  own trials run one after another (`sweep.parallel=1`), so its result does not depend on timing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, REPO, RESULTS, load_average, markdown_table, publish, run_process, utc_now

LR_RANGE = (1e-5, 1e-1)
SEEDS = (0, 1, 2)
LOSS_TARGET = 1.02
"""The search's best eval loss over the grid's best, at most."""
STEPS_TARGET = 0.40
"""The search's training steps over the grid's, at most."""

COMMON = ["precision=fp32", "batch_size=4", "data.max_length=32", "train.eval_steps=20", "train.eval_batches=4",
          "train.logging_steps=20", "train.save_steps=0"]
QUICK = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
         "model.num_key_value_heads=2", "model.intermediate_size=128", "model.vocab_size=512",
         "model.max_position_embeddings=64", "data.max_length=64", "data.max_examples=60", "batch_size=4",
         "precision=fp32", "train.eval_steps=5", "train.eval_batches=2", "train.logging_steps=5",
         "train.save_steps=0"]
"""--quick: the tests' tiny model and corpus, 20 steps, rungs at 5 and 15."""


def grid_points(num_points: int) -> list[str]:
    """`num_points` lrs log-spaced over LR_RANGE, both ends included, as the override values."""
    lo, hi = (math.log10(v) for v in LR_RANGE)
    return [f"{10 ** (lo + (hi - lo) * i / (num_points - 1)):.3g}" for i in range(num_points)]


def multirun(args: list[str], sweep_dir: Path, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """`python -m llmexp --multirun ARGS hydra.sweep.dir=SWEEP_DIR`, then llmexp's sweep report of it.

    A sweep whose grid points diverge exits 1 by design (the report says which): only the report counts."""
    result = run_process([PY, "-m", "llmexp", "--multirun", *args, f"hydra.sweep.dir={sweep_dir}"], env=env,
                         timeout_s=timeout_s)
    if not (sweep_dir / "multirun.yaml").is_file():
        raise RuntimeError(f"the sweep in {sweep_dir} did not start (exit {result.returncode}):\n{result.tail}")
    from llmexp.report.sweep import write_sweep_report

    summary = write_sweep_report(sweep_dir)  # the same report the sweep wrote, re-read from its files
    summary["wall_s"], summary["returncode"] = result.wall_s, result.returncode
    return summary


def grid_facts(summary: dict[str, Any]) -> dict[str, Any]:
    """The landscape: each point's lr, status, final eval loss and steps; the best finished point."""
    from llmexp.rundir.read import FINISHED

    points = [{"lr": float(j["params"]["lr"]), "status": j["status"], "eval_loss": j["eval_loss"],
               "steps": j["step"] or 0} for j in summary["jobs"]]
    finished = [p for p in points if p["status"] in FINISHED and isinstance(p["eval_loss"], float)
                and math.isfinite(p["eval_loss"])]
    best = min(finished, key=lambda p: p["eval_loss"]) if finished else None
    return {"points": points, "steps": sum(p["steps"] for p in points), "best_loss": best and best["eval_loss"],
            "best_lr": best and best["lr"], "wall_s": summary["wall_s"]}


def search_facts(summary: dict[str, Any], seed: int) -> dict[str, Any]:
    """One search: its trials (lr, state, value, steps), steps spent, best value and its lr."""
    search = summary["search"]
    if search is None:
        raise RuntimeError(f"{summary['sweep_dir']} holds no optuna study: did the sweep run sweep=tpe?")
    trials = [{"number": r["number"], "lr": r["params"].get("lr"), "state": r["state"], "value": r["value"],
               "last_eval_loss": r["last_eval_loss"], "steps": r["steps"], "best_so_far": r["best_so_far"],
               "stopped_step": r["stopped_step"]} for r in search["trials"]]
    best = next((t for t in trials if t["number"] == search["best_trial"]), None)
    return {"seed": seed, "trials": trials, "counts": search["counts"], "steps": search["steps_spent"],
            "best_loss": search["best_value"], "best_lr": best and best["lr"], "wall_s": summary["wall_s"]}


def ratios(grid: dict[str, Any], searches: list[dict[str, Any]]) -> dict[str, Any]:
    for s in searches:
        s["loss_ratio"] = s["best_loss"] / grid["best_loss"] if s["best_loss"] and grid["best_loss"] else math.nan
        s["steps_ratio"] = s["steps"] / grid["steps"] if grid["steps"] else math.nan
    loss = statistics.median(s["loss_ratio"] for s in searches)
    steps = statistics.median(s["steps_ratio"] for s in searches)
    return {"median_loss_ratio": loss, "median_steps_ratio": steps, "median_best_loss":
            statistics.median(s["best_loss"] if s["best_loss"] else math.nan for s in searches),
            "median_steps": statistics.median(s["steps"] for s in searches),
            "loss_target_met": loss <= LOSS_TARGET, "steps_target_met": steps <= STEPS_TARGET}


def fmt_lr(value: Any) -> str:
    return f"{value:.2e}" if isinstance(value, float) else "–"


def result_table(grid: dict[str, Any], searches: list[dict[str, Any]], facts: dict[str, Any], setup: str) -> str:
    n_trials = len(searches[0]["trials"]) if searches else 0
    rows = [["grid, 12 points" if len(grid["points"]) == 12 else f"grid, {len(grid['points'])} points",
             f"{grid['best_loss']:.4f}", fmt_lr(grid["best_lr"]), f"{grid['steps']:,}", "1", "1",
             f"{len(grid['points'])} run", f"{grid['wall_s']:.0f} s"]]
    for s in searches:
        c = s["counts"]
        rows.append([f"tpe + asha, sweep.seed={s['seed']}", f"{s['best_loss']:.4f}" if s["best_loss"] else "–",
                     fmt_lr(s["best_lr"]), f"{s['steps']:,}", f"{s['loss_ratio']:.4f}", f"{s['steps_ratio']:.2f}",
                     f"{c['complete']} complete, {c['pruned']} pruned, {c['fail']} failed",
                     f"{s['wall_s']:.0f} s"])
    rows.append(["**median over seeds**", f"{facts['median_best_loss']:.4f}", "", f"{facts['median_steps']:,.0f}",
                 f"**{facts['median_loss_ratio']:.4f}**", f"**{facts['median_steps_ratio']:.2f}**", "", ""])
    table = markdown_table(["sweep", "best eval loss", "its lr", "training steps", "loss / grid's best",
                            "steps / grid's", f"trials (of {n_trials})", "wall"], rows)
    verdict = (f"- best eval loss within {LOSS_TARGET - 1:.0%} of the grid's best (median ratio <= {LOSS_TARGET}): "
               f"**{'pass' if facts['loss_target_met'] else 'FAIL'}** ({facts['median_loss_ratio']:.4f})\n"
               f"- at most {STEPS_TARGET:.0%} of the grid's training steps (median ratio <= {STEPS_TARGET}): "
               f"**{'pass' if facts['steps_target_met'] else 'FAIL'}** ({facts['median_steps_ratio']:.2f})")
    landscape = markdown_table(["lr", *[fmt_lr(p["lr"]) for p in grid["points"]]],
                               [["final eval loss", *[f"{p['eval_loss']:.3f}" if isinstance(p["eval_loss"], float)
                                                      and p["status"] in ("completed", "early_stopped")
                                                      else p["status"] for p in grid["points"]]]])
    return (f"# A search against a grid: `sweep=tpe sweep.pruner=asha` on the tiny model's lr landscape\n\n"
            f"Measured {utc_now()} with `benchmarks/sweep_search.py`; load average {load_average()}.\n"
            f"Settings: {setup}.\n\n{table}\n\n{verdict}\n\nThe landscape (the grid's points):\n\n{landscape}\n\n"
            "![search against grid](sweep_search.png)\n")


def plot(grid: dict[str, Any], searches: list[dict[str, Any]], path: Path) -> None:
    """The grid's landscape with every trial on it; each seed's best so far against training steps spent."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from llmexp.rundir.files import atomic_file

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    ok = [p for p in grid["points"] if p["status"] in ("completed", "early_stopped")
          and isinstance(p["eval_loss"], float) and math.isfinite(p["eval_loss"])]
    left.plot([p["lr"] for p in ok], [p["eval_loss"] for p in ok], "-", color="black", lw=1.8, marker="s", ms=5,
              label="grid (12 points)" if len(grid["points"]) == 12 else "grid")
    bad = [p for p in grid["points"] if p not in ok]
    if bad:
        left.plot([p["lr"] for p in bad], [0.97] * len(bad), "x", color="#d62728", ms=9, mew=2,
                  transform=left.get_xaxis_transform(), label="grid point diverged / failed")
    colours = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")
    for s, colour in zip(searches, colours, strict=False):
        done = [t for t in s["trials"] if t["state"] == "complete"]
        cut = [t for t in s["trials"] if t["state"] == "pruned" and t["last_eval_loss"] is not None]
        left.plot([t["lr"] for t in done], [t["value"] for t in done], "o", color=colour, ms=6,
                  label=f"seed {s['seed']}: complete (final)")
        left.plot([t["lr"] for t in cut], [t["last_eval_loss"] for t in cut], "o", mfc="none", color=colour, ms=6,
                  label=f"seed {s['seed']}: pruned (when stopped)")
        steps, best, total = [0], [math.nan], 0
        for t in s["trials"]:
            total += t["steps"]
            steps.append(total)
            best.append(t["best_so_far"] if t["best_so_far"] is not None else math.nan)
        right.step(steps, best, where="post", color=colour, lw=1.8, label=f"tpe + asha, seed {s['seed']}")
    if grid["best_loss"]:
        for ax in (left, right):
            ax.axhline(grid["best_loss"], color="black", ls=":", lw=1, label="grid's best")
            ax.axhline(grid["best_loss"] * LOSS_TARGET, color="#2ca02c", ls="--", lw=1,
                       label=f"grid's best + {LOSS_TARGET - 1:.0%}")
    right.axvline(grid["steps"] * STEPS_TARGET, color="#d62728", ls="--", lw=1,
                  label=f"{STEPS_TARGET:.0%} of the grid's steps")
    right.plot([grid["steps"]], [grid["best_loss"]], "s", color="black", ms=7, label="the grid, all points")
    left.set_xscale("log")
    left.set_xlabel("lr")
    left.set_ylabel("eval loss")
    left.set_title("the landscape: final eval loss by lr")
    right.set_xlabel("training steps spent (cumulative)")
    right.set_ylabel("best final eval loss so far")
    right.set_title("best so far against steps spent")
    lows = [v for v in [grid["best_loss"], *[s["best_loss"] for s in searches], *[p["eval_loss"] for p in ok]] if v]
    if lows:  # the landscape whole (a trial pruned early at a blown-up loss may fall above it); the race zoomed in
        lo, hi = min(lows), max(lows)
        left.set_ylim(lo - 0.03 * (hi - lo or 1), hi + 0.05 * (hi - lo or 1))
        right.set_ylim(lo - 0.2 * (grid["best_loss"] * LOSS_TARGET - lo), grid["best_loss"] * (2 * LOSS_TARGET - 1))
    for ax, corner in ((left, "lower left"), (right, "upper right")):  # where the points are not
        ax.grid(alpha=0.25)
        ax.legend(fontsize=7, loc=corner)
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: QUICK model, 3 grid points, seed 0, "
                        "4 trials of 20 steps; JSON facts, no result file")
    parser.add_argument("--points", type=int, default=12, help="grid points")
    parser.add_argument("--trials", type=int, default=12, help="sweep.n_trials of each search")
    parser.add_argument("--steps", type=int, default=200, help="train.max_steps of every run")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="sweep seeds, comma-separated")
    parser.add_argument("--concurrency", type=int, default=2, help="sweeps at once (each on cores/N threads)")
    parser.add_argument("--keep", default="", help="keep the sweep directories here (default: a temp dir)")
    parser.add_argument("--out", default="sweep_search.md", help="result file in benchmarks/results/ ('': none)")
    args = parser.parse_args()
    if args.quick:
        args.points, args.trials, args.steps, args.seeds, args.out = 3, 4, 20, "0", ""
    seeds = [int(s) for s in args.seeds.split(",")]
    common = [*(QUICK if args.quick else COMMON), f"train.max_steps={args.steps}"]
    with tempfile.TemporaryDirectory(prefix="llmexp-bench-search-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        threads = max(1, (os.cpu_count() or 1) // args.concurrency)
        # PYTHONPATH: Hydra's plugin scan cannot see hydra_plugins/ through setuptools' editable hook.
        env = {"LLMEXP_CACHE": os.environ.get("LLMEXP_CACHE", str(work / "cache")), "PYTHONPATH": str(REPO),
               "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
        warm = run_process([PY, "-m", "llmexp", *common, "train.max_steps=1", f"hydra.run.dir={work / 'warmup'}"],
                           env=env)  # trains and caches the tokenizer once, before the sweeps share it
        if warm.returncode != 0:
            raise RuntimeError(f"the warm-up run failed:\n{warm.tail}")
        timeout_s = 3600.0
        grid_args = [*common, f"lr={','.join(grid_points(args.points))}"]
        search_args = [*common, "sweep=tpe", "sweep.pruner=asha", f"sweep.n_trials={args.trials}",
                       "sweep.parallel=1", f"lr=tag(log,interval({LR_RANGE[0]:g},{LR_RANGE[1]:g}))"]
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            grid_job = pool.submit(multirun, grid_args, work / "grid", env, timeout_s)
            search_jobs = [pool.submit(multirun, [*search_args, f"sweep.seed={seed}"], work / f"tpe-seed{seed}",
                                       env, timeout_s) for seed in seeds]
            grid = grid_facts(grid_job.result())
            searches = [search_facts(job.result(), seed) for job, seed in zip(search_jobs, seeds, strict=True)]
        wall_s = time.perf_counter() - start
    if grid["best_loss"] is None:
        raise RuntimeError("no grid point finished: nothing to compare against")
    facts = ratios(grid, searches)
    setup = (f"`{' '.join(common)}`, grid `lr` = {args.points} points log-spaced over [1e-5, 1e-1], search "
             f"`sweep=tpe sweep.pruner=asha sweep.n_trials={args.trials} sweep.parallel=1 "
             f"'lr=tag(log,interval(1e-5,1e-1))'`, sweep seeds {args.seeds}; {args.concurrency} sweeps at once on "
             f"{threads} thread(s) each; {wall_s / 60:.1f} min in all")
    text = result_table(grid, searches, facts, setup)
    publish(text, args.out)
    if args.out:
        plot(grid, searches, RESULTS / Path(args.out).with_suffix(".png").name)
    print(f"search/grid: best eval loss ratio {facts['median_loss_ratio']:.4f} (target <= {LOSS_TARGET}), "
          f"training steps ratio {facts['median_steps_ratio']:.2f} (target <= {STEPS_TARGET}), "
          f"medians over seeds {args.seeds}", file=sys.stderr)
    print(json.dumps({**facts, "grid": grid, "searches": searches, "wall_s": wall_s}, default=str))


if __name__ == "__main__":
    main()
