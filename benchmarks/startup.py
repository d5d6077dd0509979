"""Start-up time: `--help`, `--cfg job`, and the time from the command to the first training step.

    python benchmarks/startup.py                 # 3 repetitions each, after one warming run
    python benchmarks/startup.py --reps 5

The first-step figure is for a cached default run (`python -m llmexp` with its defaults; the
tokenizer, token arrays and matmul ceiling are cached by the warming run): the wall time from
starting the process to the moment its first train record reaches metrics.jsonl, which
includes the step-0 eval. The same record's `time_s` (seconds since the trainer set up) splits
it into imports + config composition, and the trainer's own start. Targets: `--help` <= 1 s,
first step <= 6 s. Writes benchmarks/results/startup.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, REPO, Series, load_average, markdown_table, publish, run_process, utc_now

FIRST_STEP = ["train.logging_steps=1", "train.max_steps=50"]


def time_command(args: list[str]) -> float:
    res = run_process([PY, *args])
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed (exit {res.returncode}):\n{res.tail}")
    return res.wall_s


def first_step(run_dir: Path, timeout_s: float = 600) -> tuple[float, float]:
    """(seconds from the command to the first train record, that record's time_s); the run is then stopped."""
    metrics = run_dir / "metrics.jsonl"
    env = {**os.environ, "LLMEXP_NO_BAR": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen([PY, "-m", "llmexp", *FIRST_STEP, f"hydra.run.dir={run_dir}"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while time.perf_counter() - start < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended before its first step (exit {proc.returncode}):\n"
                                   f"{proc.stderr.read()[-3000:] if proc.stderr else ''}")
            if metrics.exists():
                for line in metrics.read_text().splitlines():
                    record = json.loads(line) if line.endswith("}") else {}
                    if record.get("event") == "train":
                        return time.perf_counter() - start, float(record["time_s"])
            time.sleep(0.01)
        raise TimeoutError(f"no train record within {timeout_s} s")
    finally:
        if proc.poll() is None:
            proc.kill()  # our own child; its run directory is a temporary one
        proc.wait()


def import_seconds(module: str) -> float:
    """Wall time of `python -c "import <module>"` (one fresh process)."""
    return time_command(["-c", f"import {module}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="startup.md", help="file name under benchmarks/results/ ('' skips)")
    args = parser.parse_args()
    names = ("python", "torch", "transformers", "help", "cfg", "first", "setup", "trainer")
    series = {name: Series() for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        first_step(Path(tmp) / "warm")  # fills the caches a default run needs (tokenizer, tokens, ceiling)
        for rep in range(args.reps):
            series["python"].values.append(time_command(["-c", "pass"]))
            series["torch"].values.append(import_seconds("torch"))
            series["transformers"].values.append(import_seconds("transformers"))
            series["help"].values.append(time_command(["-m", "llmexp", "--help"]))
            series["cfg"].values.append(time_command(["-m", "llmexp", "--cfg", "job"]))
            total, in_trainer = first_step(Path(tmp) / f"run{rep}")
            series["first"].values.append(total)
            series["trainer"].values.append(in_trainer)
            series["setup"].values.append(total - in_trainer)
            print(f"rep {rep + 1}: --help {series['help'].values[-1]:.2f} s, first step {total:.2f} s",
                  file=sys.stderr, flush=True)
    rows = [
        ["`python -c pass` (interpreter floor)", "", series["python"]],
        ["`import torch`", "", series["torch"]],
        ["`import transformers`", "", series["transformers"]],
        ["`python -m llmexp --help`", "≤ 1 s", series["help"]],
        ["`python -m llmexp --cfg job`", "", series["cfg"]],
        ["command → first training step (cached default run)", "≤ 6 s", series["first"]],
        ["… of which imports, config, checks until the trainer starts", "", series["setup"]],
        ["… of which the trainer: data, model, step-0 eval, step 1", "", series["trainer"]],
    ]
    table = markdown_table(["what", "target", "seconds (median)", "spread"],
                           [[a, b, f"{s.median():.2f}", s.spread("{:.2f}")] for a, b, s in rows])
    text = (f"Measured {utc_now()}, {args.reps} fresh processes each; load average at the end: "
            f"{load_average()}.\n\n{table}")
    publish(text, args.out)


if __name__ == "__main__":
    main()
