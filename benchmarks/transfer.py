"""muTransfer in miniature (issue 38): does the best lr of a narrow model hold for a wide one?

For each parametrization (standard, muP) and seed one real sweep, `python -m llmexp --multirun`, over
model.width_mult x lr on the default data with one fixed schedule, then `python -m llmexp.fit` on the seeds' sweeps
(a point's loss is the mean over the seeds): per width the best lr (the vertex of a parabola in log lr, not the
grid's argmin) and the loss at the grid's best; across widths by how many factor-2 steps the best lr moved.
Goal (Tensor Programs V): under muP it moves by at most one step across 16x of width, and muP's best
loss at the widest width is no worse than the standard parametrization's.

    python benchmarks/transfer.py                     # widths 64..512 (x1..x8), 8 lrs a factor 2 apart, 1 seed
    python benchmarks/transfer.py --width-mults 1,2,4,8,16 --seeds 0,1,2    # the issue's 64..1024, 3 seeds
    python benchmarks/transfer.py --quick             # x1,x2,x4, 5 lrs, 40 steps: the path, not the figure

The base model is EleutherAI's nanoGPT-mup transfer template in small: head size 64 fixed (one head at width 64,
heads grow with the width), 2 layers, vocabulary 8192, sequence 128, batch 8, AdamW, warm-up + cosine over
`--steps`. Writes benchmarks/results/transfer.md and each parametrization's fit picture,
docs/assets/transfer_<standard|mup>.png (the tune-small-train-big tutorial shows them).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, REPO, load_average, machine, markdown_table, publish, run_process, utc_now

BASE_WIDTH = 64
MODEL = [f"model.hidden_size={BASE_WIDTH}", "model.num_attention_heads=1", "model.num_key_value_heads=1",
         "model.intermediate_size=172", "model.num_hidden_layers=2", f"model.mup_base_width={BASE_WIDTH}"]
"""The base-width model, head size 64 (mup_crosscheck.py checks llmexp's muP on it)."""
BASE = [*MODEL, "data.max_length=128", "batch_size=8", "optimizer=adamw", "scheduler=cosine", "train.save_steps=0",
        "train.save_final=false", "train.eval_batches=8", "train.logging_steps=50"]
PARAMETRIZATIONS = ("standard", "mup")
ASSETS = REPO / "docs" / "assets"


def lr_grid(count: int, top: float) -> list[float]:
    """`count` lrs a factor 2 apart, the highest `top`."""
    return [top / 2 ** i for i in reversed(range(count))]


def sweep(out: Path, parametrization: str, seed: str, args: argparse.Namespace) -> Path:
    """One parametrization's sweep over width x lr at one seed; its directory. A sweep a seed (not `seed=0,1,2` in
    one): a finished seed's jobs keep their numbers when a seed is added, so a rerun with more seeds reuses them."""
    sweep_dir = out / parametrization / f"seed{seed}"
    lrs = ",".join(f"{lr:.4g}" for lr in lr_grid(args.lrs, args.top_lr))
    mults = args.mup_mults.split(",") if parametrization == "mup" else []  # alpha_input, alpha_output
    mults = [f"model.mup_input_mult={mults[0]}", f"model.mup_output_mult={mults[1]}"] if mults else []
    cmd = [PY, "-m", "llmexp", "--multirun", *BASE, f"model.parametrization={parametrization}", *mults,
           f"model.width_mult={args.width_mults}", f"lr={lrs}", f"seed={seed}",
           f"train.max_steps={args.steps}", f"train.eval_steps={args.steps}", f"cluster.max_parallel={args.jobs}",
           f"hydra.sweep.dir={sweep_dir}"]
    result = run_process(cmd, timeout_s=24 * 3600)
    if result.returncode not in (0, 1):  # 1: a job diverged or failed; the fit says which lrs are missing
        raise SystemExit(f"the {parametrization} sweep (seed {seed}) exited {result.returncode}:\n{result.tail}")
    return sweep_dir


def fit(sweep_dirs: list[Path], out: Path) -> dict:
    """`llmexp.fit` over one parametrization's sweeps (its seeds pooled: a point's loss is the mean over them)."""
    result = run_process([PY, "-m", "llmexp.fit", *map(str, sweep_dirs), "--out", str(out)], timeout_s=600)
    if result.returncode != 0:
        raise SystemExit(f"llmexp.fit on {out} exited {result.returncode}:\n{result.tail}")
    return json.loads((out / "fit.json").read_text())


def width_rows(fits: dict[str, dict]) -> list[list[str]]:
    """A row a width: its best lr (with the fit's bootstrap interval, where seeds gave it the loss's noise), the
    grid's best, the best loss (a mean over the seeds) and the noise of one run's loss."""
    rows = []
    for name, result in fits.items():
        for size in result["sizes"]:
            best, grid_best, interval, noise = size["best_lr"], size["grid_best_lr"], size["interval"], size["noise"]
            loss = min(p["loss"] for p in size["points"])
            shown = f"{best:.3g}" if best else f"edge ({size['edge']})"
            if best and interval:
                shown += f" [{interval[0]:.3g}, {interval[1]:.3g}]"
            rows.append([name, f"{size['params'] / 1e6:.2f}M", shown, f"{grid_best:.3g}", f"{loss:.4f}",
                         f"{noise:.4f}" if noise else "–"])
    return rows


def shift(result: dict) -> float | None:
    """By how many factor-2 steps the best lr moved across the widths (the vertices', where every width has one)."""
    best = [s["best_lr"] for s in result["sizes"]]
    return None if None in best or len(best) < 2 else math.log2(max(best) / min(best))


def verdict(fits: dict[str, dict]) -> list[str]:
    lines = []
    for name, result in fits.items():
        moved = shift(result)
        amount = (f"{moved:.2f} factor-2 steps" if moved is not None
                  else "an unknown amount (a width has its best lr at the grid's edge)")
        lines.append(f"- {name}: the best lr moved by {amount} across the widths")
    widest = {name: min(p["loss"] for p in r["sizes"][-1]["points"]) for name, r in fits.items()}
    lines.append(f"- at the widest width, the best loss: standard {widest['standard']:.4f}, muP {widest['mup']:.4f}")
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width-mults", default="1,2,4,8", help="model.width_mult values (base width 64)")
    parser.add_argument("--lrs", type=int, default=8, help="lrs in the grid, a factor 2 apart")
    parser.add_argument("--top-lr", type=float, default=3.2e-2, help="the grid's highest lr")
    parser.add_argument("--seeds", default="0", help="seeds, comma-separated")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--jobs", type=int, default=2, help="jobs at a time (cluster.max_parallel)")
    parser.add_argument("--work", help="where the sweeps go (kept; a rerun with the same one resumes them)")
    parser.add_argument("--out", default="transfer.md", help="file under benchmarks/results ('' for none)")
    parser.add_argument("--mup-mults", default="1,1", help="muP's alpha_input,alpha_output (model.mup_input_mult, "
                        "model.mup_output_mult), tuned at the base width")
    parser.add_argument("--quick", action="store_true", help="x1,x2,x4, 5 lrs, 40 steps: the path, not the figure")
    args = parser.parse_args()
    if args.quick:
        args.width_mults, args.lrs, args.steps, args.top_lr, args.out = "1,2,4", 5, 40, 3.2e-2, ""
    return args


def main() -> None:
    args = parse_args()
    started, load_start = utc_now(), load_average()
    work = Path(args.work or tempfile.mkdtemp(prefix="llmexp-transfer-"))  # kept: a sweep is minutes of runs
    print(f"sweeps in {work}", file=sys.stderr)
    fits = {name: fit([sweep(work, name, seed, args) for seed in args.seeds.split(",")], work / name)
            for name in PARAMETRIZATIONS}
    if args.out:  # the fits' pictures, which the tune-small-train-big tutorial shows
        for name in PARAMETRIZATIONS:
            shutil.copyfile(work / name / "fit.png", ASSETS / f"{Path(args.out).stem}_{name}.png")
    head = (f"# muTransfer in miniature\n\nMeasured {started} on {machine()}; load average {load_start} at the start, "
            f"{load_average()} at the end. Widths {BASE_WIDTH} x ({args.width_mults}), head size 64, 2 layers, "
            f"{args.lrs} lrs a factor 2 apart up to {args.top_lr:g}, seeds {args.seeds}, {args.steps} steps of 8 x "
            "128 tokens (warm-up + cosine), AdamW, the default data; muP's alpha_input, alpha_output: "
            f"{args.mup_mults}.\n")
    table = markdown_table(["parametrization", "params", "best lr (vertex) [95% interval]", "grid's best lr",
                            "best loss (mean)", "loss noise (sd a run)"],
                           width_rows(fits))
    publish("\n".join([head, table, "", *verdict(fits)]), args.out)


if __name__ == "__main__":
    main()
