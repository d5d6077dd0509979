"""What in-loop task evals cost (issue 29, item 7). (Whether `lr=find` picks an lr a grid would: lr_finder.py.)

    python benchmarks/evals.py                # the default run with and without eval=demo
    python benchmarks/evals.py --rounds 2     # two alternating rounds
    python benchmarks/evals.py --quick        # proves the script works on a few steps: no figures to publish

The default run (`python -m llmexp`) against `python -m llmexp eval=demo` (200 items of the demo task
   at each of the four evals), alternately in fresh processes with the cache warm; the share of the demo run's
   wall time spent in task evals (the `seconds` of its eval_task records), and the wall-time ratio of the two
   runs paired within each round. The demo accuracy at the first and the last eval is printed beside them.

Every arm goes through the CLI, as a user runs it. Writes benchmarks/results/evals_cost.md (`--out ''` skips).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, load_average, machine, markdown_table, publish, run_process, utc_now

QUICK = ["train.max_steps=12", "train.eval_steps=6"]
QUICK_DEMO = ["eval.demo_items=40"]




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


def report(parts: list[str], started: str, load_start: str) -> str:
    head = (f"# In-loop task evals, measured ({started}; {machine()}; load average at the start "
            f"{load_start}, at the end {load_average()})\n")
    return "\n".join([head, *parts])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="evals_cost.md", help="file under benchmarks/results ('' for none)")
    args = parser.parse_args()
    started, load_start = utc_now(), load_average()
    extra = QUICK if args.quick else []
    with tempfile.TemporaryDirectory(prefix="llmexp-evals-") as tmp:
        root = Path(tmp)
        env = {"LLMEXP_CACHE": str(root / "cache")}
        cost = cost_report(measure_cost(root, args.rounds, extra, QUICK_DEMO if args.quick else [], env))
    publish(report([cost], started, load_start), "" if args.quick else args.out)


if __name__ == "__main__":
    main()
