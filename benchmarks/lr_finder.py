"""Does `lr=find` land on a grid's best lr, and which rule reads the pick best off its curve? (issue 38, item 5)

For each model, on the default data with one fixed schedule (150 steps of 8 x 128 tokens, warm-up + cosine, AdamW):
1. range tests, `python -m llmexp.lr_find`: 100 steps from 1e-7 to 10 (fastai's and Lightning's defaults), 200
   steps over the same range, and 200 steps from 1e-5 to 1 (the smoothing lags 2x and 3.2x fewer decades), each
   with two seeds (another init and other batches); lr_find.json
   records the pick of every rule (`train.lr_find_rule`: minimum / 10, steep, valley) off the same curve;
2. one grid sweep, `python -m llmexp --multirun lr=...`, lrs a factor sqrt(2) apart, and `python -m llmexp.fit` on
   it: the grid's best lr is the vertex of a parabola in log lr through the final eval losses near the minimum.
A rule lands when its pick is within 1.5x of the grid's best. The models: the default (`model=tiny`, width 256,
4 layers) and the same twice as wide (`model.width_mult=2`, width 512: the issue's "wider model").

    python benchmarks/lr_finder.py              # both models, 10 lrs each; ~40 min on 2 cores
    python benchmarks/lr_finder.py --quick      # the default model, 5 lrs, 30 steps: the path, not the figure

Writes benchmarks/results/lr_finder.md and docs/assets/lr_finder.png (each model's range-test curve, the grid's
losses on the same lr axis, each rule's pick and the 1.5x band around the grid's best).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, REPO, load_average, machine, markdown_table, publish, run_process, utc_now
from transfer import fit

from llmexp.config.keys import leaves

RULES = leaves()["train.lr_find_rule"].rule.options
"""The rules lr_find.json records a pick for: train.lr_find_rule's options, read from its schema field."""

SCHEDULE = ["data.max_length=128", "batch_size=8", "optimizer=adamw", "scheduler=cosine", "train.save_steps=0",
            "train.save_final=false", "train.eval_batches=8", "train.logging_steps=50"]
MODELS = {"default (width 256)": [], "wide (width 512)": ["model.width_mult=2"]}
TESTS = {"100 steps, 1e-7 to 10": ["train.lr_find_steps=100", "train.lr_find_start=1e-7", "train.lr_find_end=10"],
         "200 steps, 1e-7 to 10": ["train.lr_find_steps=200", "train.lr_find_start=1e-7", "train.lr_find_end=10"],
         "200 steps, 1e-5 to 1": ["train.lr_find_steps=200", "train.lr_find_start=1e-5", "train.lr_find_end=1"]}
"""The range tests: fastai's and Lightning's range at 100 steps (their default), at 200, and 200 steps on half the
decades: the smoothing's lag (~49 steps) spans 4, 2 and 1.2 decades of lr."""
LANDS = 1.5
PICTURE = REPO / "docs" / "assets" / "lr_finder.png"


def lr_grid(count: int, top: float) -> list[float]:
    """`count` lrs a factor sqrt(2) apart, the highest `top`."""
    return [top / 2 ** (i / 2) for i in reversed(range(count))]


def range_test(run_dir: Path, overrides: list[str], steps: int) -> dict:
    """One range test's lr_find.json (a rerun in the same directory reads it: the test is not run again)."""
    result = run_process([PY, "-m", "llmexp.lr_find", *SCHEDULE, *overrides, f"train.max_steps={steps}",
                          f"hydra.run.dir={run_dir}"], timeout_s=3600)
    if result.returncode != 0:
        raise SystemExit(f"lr_find exited {result.returncode}:\n{result.tail}")
    return json.loads((run_dir / "lr_find.json").read_text())


def range_tests(work: Path, model: list[str], args: argparse.Namespace) -> dict[tuple[str, int], dict]:
    """(test, seed) -> its lr_find.json."""
    return {(test, seed): range_test(work / f"rt{t}_s{seed}", [*model, *TESTS[test], f"seed={seed}"], args.steps)
            for t, test in enumerate(TESTS) for seed in args.seeds}


def grid(work: Path, model: list[str], args: argparse.Namespace) -> dict:
    sweep_dir = work / "grid"
    lrs = ",".join(f"{lr:.4g}" for lr in lr_grid(args.lrs, args.top_lr))
    result = run_process([PY, "-m", "llmexp", "--multirun", *SCHEDULE, *model, f"lr={lrs}",
                          f"train.max_steps={args.steps}", f"train.eval_steps={args.steps}",
                          f"cluster.max_parallel={args.jobs}", f"hydra.sweep.dir={sweep_dir}"], timeout_s=6 * 3600)
    if result.returncode not in (0, 1):  # 1: a job diverged; the fit works with the rest
        raise SystemExit(f"the grid exited {result.returncode}:\n{result.tail}")
    return fit(sweep_dir)["sizes"][0]


def factor(lr: float, best: float) -> float:
    return max(lr / best, best / lr)


def rows(found: dict[str, dict], grids: dict[str, dict]) -> list[list[str]]:
    out = []
    for name, tests in found.items():
        best = grids[name]["best_lr"]
        for (test, seed), result in tests.items():
            for rule, lr in result["picks"].items():
                f = factor(lr, best) if best else None
                out.append([name, test, str(seed), rule, f"{lr:.3g}",
                            f"{best:.3g}" if best else f"edge ({grids[name]['edge']})", f"{f:.2f}×" if f else "-",
                            "yes" if f and f <= LANDS else "no"])
    return out


def follows_the_range(found: dict[str, dict], rule: str) -> float:
    """How far `rule`'s pick moves between the two 200-step tests (the same steps; the range starts 100x higher):
    a pick that reads the model stays put, a pick that reads the range moves with it (the worst over models and
    seeds)."""
    same_steps, moved = list(TESTS)[1:], []
    for tests in found.values():
        for seed in {seed for _, seed in tests}:
            a, b = (tests[(test, seed)]["picks"][rule] for test in same_steps)
            moved.append(max(a / b, b / a))
    return max(moved)


def verdict(found: dict[str, dict], grids: dict[str, dict]) -> tuple[list[str], tuple[str, str] | None]:
    """Per test and rule: the worst factor over models and seeds, and how far the seeds' picks lie apart (the
    noise of one range test). The pick: the smallest worst case among the rules whose pick does not follow the
    range (moves under 2x when its start moves 100x)."""
    lines, worst = [], {}
    for test in TESTS:
        for rule in RULES:
            factors, spreads = [], []
            for name, tests in found.items():
                picks = [r["picks"][rule] for (t, _), r in tests.items() if t == test]
                if grids[name]["best_lr"] and picks:
                    factors += [factor(lr, grids[name]["best_lr"]) for lr in picks]
                    spreads.append(max(picks) / min(picks))
            if factors:
                worst[(test, rule)] = max(factors)
                lines.append(f"- {test}, {rule}: at worst {max(factors):.2f}× from the grid's best; the seeds' "
                             f"picks up to {max(spreads):.2f}× apart")
    moved = {rule: follows_the_range(found, rule) for rule in RULES}
    lines.append("- a range starting 100× higher (1e-7 → 1e-5, 200 steps each) moved the picks by up to: "
                 + ", ".join(f"{rule} {m:.2f}×" for rule, m in moved.items()))
    steady = {k: v for k, v in worst.items() if moved[k[1]] < 2}
    if not steady:
        return lines, None
    test, rule = min(steady, key=steady.__getitem__)
    lines.append(f"- the smallest worst case of a pick that does not follow the range: **{rule}** on the {test} "
                 f"test, {steady[(test, rule)]:.2f}×")
    return lines, (test, rule)


def draw(found: dict[str, dict], grids: dict[str, dict], marks: list[tuple[str, str]], path: Path) -> None:
    """Per model: each range test's smoothed curve (the first seed), the grid's final eval losses on a second axis,
    the 1.5x band around the grid's best, and the picks of the (test, rule) pairs in `marks`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(TESTS, ("#1f77b4", "#2ca02c", "#9467bd"), strict=True))
    styles = {"minimum": "--", "steep": "-.", "valley": ":"}
    fig, axes = plt.subplots(1, len(found), figsize=(6.5 * len(found), 4.8), squeeze=False)
    for ax, name in zip(axes[0], found, strict=True):
        size, twin, low = grids[name], ax.twinx(), math.inf
        first = min(seed for _, seed in found[name])
        for test in TESTS:
            curve = [c for c in found[name][(test, first)]["curve"] if math.isfinite(c["smoothed"])]
            low = min(low, *(c["smoothed"] for c in curve))
            ax.plot([c["lr"] for c in curve], [c["smoothed"] for c in curve], color=colors[test], lw=1.2,
                    label=f"range test, {test}")
        for test, rule in marks:
            lr = found[name][(test, first)]["picks"][rule]
            ax.axvline(lr, color=colors[test], ls=styles[rule], lw=2, label=f"{rule} pick {lr:.3g} ({test})")
        ax.set_ylim(low - 0.3, low + 1.8)
        points = sorted(size["points"], key=lambda p: p["lr"])
        twin.plot([p["lr"] for p in points], [p["loss"] for p in points], "o-", color="#ff7f0e", ms=4,
                  label="grid: final eval loss")
        twin.set_ylabel("grid: final eval loss")
        if size["best_lr"]:
            ax.axvspan(size["best_lr"] / LANDS, size["best_lr"] * LANDS, color="#ff7f0e", alpha=0.15,
                       label=f"grid's best {size['best_lr']:.3g} ± {LANDS}×")
        ax.set_xscale("log")
        ax.set_xlim(1e-6, 1)
        ax.set_xlabel("learning rate")
        ax.set_ylabel("range test: smoothed train loss")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.25, which="both")
        ax.legend(fontsize=6, loc="upper left")
        twin.legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lrs", type=int, default=10, help="lrs in each grid, a factor sqrt(2) apart")
    parser.add_argument("--top-lr", type=float, default=8e-3, help="the grid's highest lr")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", default="0,1", help="the range tests' seeds (the grid runs seed 0)")
    parser.add_argument("--jobs", type=int, default=2, help="grid jobs at a time (cluster.max_parallel)")
    parser.add_argument("--models", default=",".join(MODELS), help="which of: " + ", ".join(MODELS))
    parser.add_argument("--work", help="where the runs go (kept; a rerun with the same one reads the finished range "
                                           "tests and grid jobs, and resumes the rest)")
    parser.add_argument("--out", default="lr_finder.md", help="file under benchmarks/results ('' for none)")
    parser.add_argument("--quick", action="store_true", help="the default model, 5 lrs, 30 steps, one seed: the path")
    args = parser.parse_args()
    args.seeds = [int(seed) for seed in args.seeds.split(",")]
    if args.quick:
        args.lrs, args.steps, args.models, args.seeds, args.out = 5, 30, next(iter(MODELS)), [0], ""
    return args


def main() -> None:
    args = parse_args()
    started, load_start = utc_now(), load_average()
    work = Path(args.work or tempfile.mkdtemp(prefix="llmexp-lr-finder-"))
    print(f"runs in {work}", file=sys.stderr)
    names = args.models.split(",")
    found = {name: range_tests(work / str(i), MODELS[name], args) for i, name in enumerate(names)}
    grids = {name: grid(work / str(i), MODELS[name], args) for i, name in enumerate(names)}
    lines, winner = verdict(found, grids)
    if args.out:  # fastai's defaults (100 steps, minimum / 10) against the measured best
        draw(found, grids, [(next(iter(TESTS)), "minimum"), *([winner] if winner else [])], PICTURE)
    lrs = lr_grid(args.lrs, args.top_lr)
    tests = " and ".join(TESTS)
    seeds = ", ".join(map(str, args.seeds))
    head = (f"# lr=find against a grid\n\nMeasured {started} on {machine()}; load average {load_start} at the start, "
            f"{load_average()} at the end. Each model: range tests (`python -m llmexp.lr_find`: {tests}; seeds "
            f"{seeds}) and a grid of {args.lrs} lrs a factor √2 apart ({lrs[0]:.3g} to {lrs[-1]:.3g}), {args.steps} "
            "steps of 8 x 128 tokens (warm-up + cosine), AdamW, the default data, seed 0; the grid's best is the "
            f"vertex of `llmexp.fit`'s parabola. A pick lands within {LANDS}× of it.\n")
    table = markdown_table(["model", "range test", "seed", "rule", "pick", "grid's best lr", "factor",
                            f"within {LANDS}×"],
                           rows(found, grids))
    publish("\n".join([head, table, "", *lines]), args.out)


if __name__ == "__main__":
    main()
