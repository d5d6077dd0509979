"""What in-loop task evals cost, and whether `lr=find` picks an lr a grid would (issue 29, item 7).

    python benchmarks/evals.py                # the default run with and without eval=demo, then the lr sweep
    python benchmarks/evals.py --rounds 2     # two alternating rounds of the cost arms
    python benchmarks/evals.py --quick        # proves the script works on a few steps: no figures to publish
    python benchmarks/evals.py --parts lr     # only the lr part (cost: only the cost part), to evals_lr.md

1. Cost: the default run (`python -m llmexp`) against `python -m llmexp eval=demo` (200 items of the demo task
   at each of the four evals), alternately in fresh processes with the cache warm; the share of the demo run's
   wall time spent in task evals (the `seconds` of its eval_task records), and the wall-time ratio of the two
   runs paired within each round. The demo accuracy at the first and the last eval is printed beside them.
2. lr: `python -m llmexp.lr_find` on the default model and data, and a grid sweep of the default run
   (`python -m llmexp --multirun lr=...`, lrs a factor 2 apart, one job at a time) whose recommendation is the
   lowest final eval loss; the finder's pick "lands" when it is within 2x of the grid's best lr.

Every arm goes through the CLI, as a user runs it. Writes benchmarks/results/evals.md (`--out ''` skips).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, load_average, machine, markdown_table, publish, run_process, utc_now

GRID = ["4e-4", "8e-4", "1.6e-3", "3.2e-3"]
"""A factor 2 apart, around the default run's known best (README: 8e-4 ended lowest of 3e-4, 6e-4, 8e-4, 1e-3)."""
QUICK = ["train.max_steps=12", "train.eval_steps=6"]
QUICK_DEMO = ["eval.demo_items=40"]
QUICK_GRID = ["4e-4", "1.6e-3"]




def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def cost_arm(root: Path, name: str, overrides: list[str], env: dict[str, str]) -> dict[str, Any]:
    run_dir = root / name
    arm = run_process([PY, "-m", "llmexp", *overrides, f"hydra.run.dir={run_dir}"], env=env, timeout_s=3600)
    if arm.returncode != 0:
        raise SystemExit(f"{name} failed:\n{arm.tail}")
    records = _records(run_dir)
    tasks = [r for r in records if r.get("event") == "eval_task"]
    return {"wall_s": arm.wall_s, "task_s": sum(r["seconds"] for r in tasks),
            "acc": [(r["step"], r["metrics"]["acc"], r["metrics"]["acc_norm"]) for r in tasks],
            "time_s": json.loads((run_dir / "summary.json").read_text())["time_s"]}


def measure_cost(root: Path, rounds: int, extra: list[str], demo: list[str],
                 env: dict[str, str]) -> list[dict[str, Any]]:
    cost_arm(root, "warmup", [*extra, "train.max_steps=1"], env)  # builds the token cache and the ceiling
    out = []
    for i in range(rounds):
        arms = [("loss", []), ("demo", ["eval=demo", *demo])]
        order = arms if i % 2 == 0 else arms[::-1]
        got = {name: cost_arm(root, f"{name}_{i}", [*extra, *ov], env) for name, ov in order}
        out.append(got)
        print(json.dumps({"round": i, **{k: {"wall_s": v["wall_s"], "task_s": v["task_s"]} for k, v in got.items()}}),
              flush=True)
    return out


def measure_lr(root: Path, extra: list[str], finder: list[str], grid: list[str],
               env: dict[str, str]) -> dict[str, Any]:
    find_dir = root / "lr_find"
    start = time.perf_counter()
    arm = run_process([PY, "-m", "llmexp.lr_find", *extra, *finder, f"hydra.run.dir={find_dir}"], env=env,
                      timeout_s=3600)
    if arm.returncode != 0:
        raise SystemExit(f"lr_find failed:\n{arm.tail}")
    found = json.loads((find_dir / "lr_find.json").read_text())
    find_s = time.perf_counter() - start
    sweep_dir = root / "grid"
    start = time.perf_counter()
    arm = run_process([PY, "-m", "llmexp", "--multirun", f"lr={','.join(grid)}", *extra,
                       f"hydra.sweep.dir={sweep_dir}"], env=env, timeout_s=4 * 3600)
    grid_s = time.perf_counter() - start
    summary = json.loads((sweep_dir / "sweep_summary.json").read_text())
    jobs = {j["params"].get("lr"): j.get("eval_loss") for j in summary["jobs"]}
    best = summary["recommendation"]["params"]["lr"] if summary["recommendation"] else None
    return {"found": found, "find_s": find_s, "grid_s": grid_s, "jobs": jobs, "best": best,
            "returncode": arm.returncode}


def cost_report(cost: list[dict[str, Any]]) -> str:
    shares = [r["demo"]["task_s"] / r["demo"]["wall_s"] for r in cost]
    ratios = [r["demo"]["wall_s"] / r["loss"]["wall_s"] for r in cost]
    rows = [[str(i), f"{r['loss']['wall_s']:.1f}", f"{r['demo']['wall_s']:.1f}", f"{r['demo']['task_s']:.1f}",
             f"{shares[i]:.1%}", f"{ratios[i]:.3f}×"] for i, r in enumerate(cost)]
    acc = cost[-1]["demo"]["acc"]
    return "\n".join([
        "## Cost of eval=demo on the default run (wall time of the whole command, cache warm)", "",
        markdown_table(["round", "eval=loss (s)", "eval=demo (s)", "task evals (s)", "share of wall time",
                        "demo / loss (paired)"], rows), "",
        f"Median share {statistics.median(shares):.1%}, median paired ratio {statistics.median(ratios):.3f}×. "
        "Demo accuracy (acc, acc_norm) by eval step in the last round: "
        + ", ".join(f"step {s}: {a:.3f}, {n:.3f}" for s, a, n in acc) + ".", ""])


def lr_report(lr: dict[str, Any]) -> str:
    found, best = lr["found"], lr["best"]
    within = best is not None and 0.5 <= found["suggestion"] / float(best) <= 2.0
    grid_rows = [[str(k), f"{v:.4f}" if isinstance(v, float) else str(v), "**best**" if k == best else ""]
                 for k, v in lr["jobs"].items()]
    steep = found["lr_steepest"]
    return "\n".join([
        "## lr=find against a grid on the default run", "",
        f"`python -m llmexp.lr_find`: {found['steps_run']} steps ({found['stopped']}), minimum of the smoothed loss "
        f"at lr {found['lr_min_loss']:.3g}, steepest descent at {steep if steep is None else f'{steep:.3g}'}; pick "
        f"{found['suggestion']:.3g} ({found['rule']}); {lr['find_s']:.0f} s.", "",
        markdown_table(["lr", "final eval loss", ""], grid_rows), "",
        f"Grid ({len(lr['jobs'])} jobs, {lr['grid_s']:.0f} s, exit {lr['returncode']}): best lr {best}. The pick is "
        f"{found['suggestion'] / float(best):.2f}× the grid's best: {'within' if within else 'NOT within'} 2×."
        if best else "Grid: no recommendation.", ""])


def report(parts: list[str], started: str, load_start: str) -> str:
    head = (f"# In-loop task evals and lr=find, measured ({started}; {machine()}; load average at the start "
            f"{load_start}, at the end {load_average()})\n")
    return "\n".join([head, *parts])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--parts", default="cost,lr", help="cost, lr or both")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="results file (default evals.md, or evals_<part>.md for one)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    started, load_start = utc_now(), load_average()
    extra = QUICK if args.quick else []
    sections = []
    with tempfile.TemporaryDirectory(prefix="llmexp-evals-") as tmp:
        root = Path(tmp)
        env = {"LLMEXP_CACHE": str(root / "cache")}
        if "cost" in parts:
            sections.append(cost_report(measure_cost(root, args.rounds, extra, QUICK_DEMO if args.quick else [], env)))
        if "lr" in parts:
            finder = ["train.lr_find_steps=10"] if args.quick else []
            sections.append(lr_report(measure_lr(root, extra, finder, QUICK_GRID if args.quick else GRID, env)))
    out = args.out if args.out is not None else "evals.md" if len(parts) > 1 else f"evals_{parts[0]}.md"
    publish(report(sections, started, load_start), "" if args.quick else out)


if __name__ == "__main__":
    main()
