"""A new user's first minutes: the wall time from `python -m llmexp` to eval perplexity ÷20, and `--help`.

    python benchmarks/first_run.py               # 1 round of the four default runs, --help 3 times
    python benchmarks/first_run.py --rounds 2
    python benchmarks/first_run.py --quick       # proves the script works (12 steps, ÷1.5): no figures to publish

Four arms per round, each the default run (`python -m llmexp`, no overrides) in a fresh process:
precision=auto as this CPU picks it, and under `LLMEXP_ASSUME_NO_BF16=1` (auto picks fp32, as on a
CPU without native bf16), each with a fresh cache (`LLMEXP_CACHE` an empty directory: BPE training,
tokenising, the matmul ceiling, all included) and then with the cache that run left (data prep
excluded: a cache hit). The clock starts at the command and stops when metrics.jsonl gains the first
eval whose perplexity is at most the step-0 eval's ÷ 20 (the target: within 3 minutes on any 2-core
x86 CPU); the whole command's wall time, the ratio it ended at and the training tokens that the
target took are printed beside it. Tokens to the target do not depend on the machine's load; the
seconds do, so the load average is printed too. It prints figures and never asserts a timing.
Writes benchmarks/results/first_run.md (`--out ''` skips).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, REPO, Series, load_average, markdown_table, publish, rotated, run_process, utc_now

TARGET_RATIO = 20.0
QUICK_OVERRIDES = ["train.max_steps=12", "train.eval_steps=6"]
QUICK_RATIO = 1.5
PRECISIONS = {"auto": {}, "no-bf16": {"LLMEXP_ASSUME_NO_BF16": "1"}}


@dataclass
class FirstRun:
    """One default run, watched from the command to its end."""

    to_target_s: float | None  # command -> the first eval at or below the target perplexity
    wall_s: float  # the whole command
    ratio: float  # step-0 eval perplexity / last eval perplexity
    target_tokens: int | None  # training tokens before the eval that met the target
    precision: str
    tokens_per_sec: float
    data_prep_s: float


def read_new_records(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete JSON lines appended to `path` since byte `offset`, and the new offset."""
    if not path.exists():
        return [], offset
    with path.open("rb") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1  # a half-written last line waits for the next poll
    lines = chunk[:end].decode().splitlines()
    return [json.loads(line) for line in lines if line.strip()], offset + end


def watch_run(run_dir: Path, env: dict[str, str], overrides: list[str], target_ratio: float,
              timeout_s: float) -> FirstRun:
    """Run `python -m llmexp` to its end, stamping the wall time at which each eval record appears."""
    metrics = run_dir / "metrics.jsonl"
    full_env = {**os.environ, "LLMEXP_NO_BAR": "1", **env}
    start = time.perf_counter()
    proc = subprocess.Popen([PY, "-m", "llmexp", *overrides, f"hydra.run.dir={run_dir}"], cwd=REPO, env=full_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    offset, ppl0, to_target_s, target_step = 0, None, None, None
    start_record: dict[str, Any] = {}
    try:
        while proc.poll() is None:
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"the default run took more than {timeout_s} s")
            records, offset = read_new_records(metrics, offset)
            for r in records:
                start_record = r if r.get("event") == "start" else start_record
                if r.get("event") != "eval":
                    continue
                ppl0 = r["eval_ppl"] if ppl0 is None else ppl0
                if to_target_s is None and r["eval_ppl"] <= ppl0 / target_ratio:
                    to_target_s, target_step = time.perf_counter() - start, int(r["step"])
            time.sleep(0.05)
        wall_s = time.perf_counter() - start
    finally:
        if proc.poll() is None:
            proc.kill()  # our own child, in a temporary run directory
        stderr = proc.stderr.read() if proc.stderr else ""
        proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the default run failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    tokens_per_step = int(start_record["global_batch_size"]) * max_length(run_dir)
    return FirstRun(to_target_s=to_target_s, wall_s=wall_s, ratio=(ppl0 or 0.0) / summary["eval_ppl"],
                    target_tokens=None if target_step is None else target_step * tokens_per_step,
                    precision=str(summary["precision"]), tokens_per_sec=float(summary["tokens_per_sec"]),
                    data_prep_s=float(start_record.get("data_prep_s", 0.0)))


def max_length(run_dir: Path) -> int:
    """Tokens per example of the run, from the config Hydra saved in its run directory."""
    from omegaconf import OmegaConf

    return int(OmegaConf.load(run_dir / ".hydra" / "config.yaml").data.max_length)


def help_seconds() -> float:
    """Wall time of one `python -m llmexp --help` in a fresh process."""
    res = run_process([PY, "-m", "llmexp", "--help"])
    if res.returncode != 0:
        raise RuntimeError(f"--help failed (exit {res.returncode}):\n{res.tail}")
    return res.wall_s


def run_rounds(rounds: int, overrides: list[str], target_ratio: float, timeout_s: float) -> dict[str, list[FirstRun]]:
    """Each round: per precision (rotated), a fresh-cache run, then a run on the cache it left."""
    results: dict[str, list[FirstRun]] = {}
    for round_index in range(rounds):
        for precision in rotated(list(PRECISIONS), round_index):
            with tempfile.TemporaryDirectory(prefix="llmexp-first-run-") as tmp:
                env = {**PRECISIONS[precision], "LLMEXP_CACHE": str(Path(tmp) / "cache")}
                for cache in ("fresh", "warm"):
                    run = watch_run(Path(tmp) / cache, env, overrides, target_ratio, timeout_s)
                    results.setdefault(f"{precision}, {cache} cache", []).append(run)
                    print(f"round {round_index + 1}, {precision}, {cache} cache: to ÷{target_ratio:g} "
                          f"{run.to_target_s if run.to_target_s is None else round(run.to_target_s, 1)} s, "
                          f"whole run {run.wall_s:.1f} s, ÷{run.ratio:.1f} ({run.precision}, "
                          f"{run.tokens_per_sec:,.0f} tokens/s)", file=sys.stderr, flush=True)
    return results


def arm_row(name: str, runs: list[FirstRun]) -> list[str]:
    reached = Series([r.to_target_s for r in runs if r.to_target_s is not None])
    wall = Series([r.wall_s for r in runs])
    tokens = {r.target_tokens for r in runs}
    return [name, runs[0].precision, f"{reached.median():.1f}" if reached.values else "not reached",
            reached.spread("{:.1f}"), f"{wall.median():.1f}", f"{Series([r.ratio for r in runs]).median():.1f}",
            ", ".join("–" if t is None else f"{t:,}" for t in sorted(tokens, key=lambda t: t or 0)),
            f"{Series([r.tokens_per_sec for r in runs]).median():,.0f}",
            f"{Series([r.data_prep_s for r in runs]).median():.1f}"]


def fresh_over_warm(results: dict[str, list[FirstRun]], precision: str) -> str:
    fresh = Series([r.wall_s for r in results[f"{precision}, fresh cache"]]).median()
    warm = Series([r.wall_s for r in results[f"{precision}, warm cache"]]).median()
    return f"{precision}: {fresh / warm:.2f}× ({fresh - warm:+.1f} s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--help-reps", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=1200)
    parser.add_argument("--quick", action="store_true",
                        help=f"{' '.join(QUICK_OVERRIDES)}, target ÷{QUICK_RATIO:g}, no results file")
    parser.add_argument("--out", default="first_run.md", help="file name under benchmarks/results/ ('' skips)")
    args = parser.parse_args()
    overrides, target_ratio = (QUICK_OVERRIDES, QUICK_RATIO) if args.quick else ([], TARGET_RATIO)
    out = "" if args.quick else args.out
    helps = Series([help_seconds() for _ in range(args.help_reps)])
    results = run_rounds(args.rounds, overrides, target_ratio, args.timeout_s)
    table = markdown_table(
        ["default run", "precision", f"command → eval ppl ÷{target_ratio:g}, s (median)", "spread",
         "whole run, s", "ppl ratio at the end", f"training tokens to ÷{target_ratio:g}", "tokens/s", "data prep, s"],
        [arm_row(name, runs) for name, runs in results.items()])
    ratios = "; ".join(fresh_over_warm(results, p) for p in PRECISIONS)
    quick = f" (--quick: {' '.join(overrides)})" if args.quick else ""
    text = (f"Measured {utc_now()}, {args.rounds} round(s){quick}"
            f"; load average at the end: {load_average()}.\n\n{table}\n\n"
            f"Whole run, fresh cache over warm cache: {ratios}.\n\n"
            f"`python -m llmexp --help`: {helps.median():.2f} s (median of {len(helps.values)}, "
            f"spread {helps.spread('{:.2f}')}; target ≤ 1 s).")
    publish(text, out)


if __name__ == "__main__":
    main()
