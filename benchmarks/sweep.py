"""Sweep launcher overhead, measured against baselines taken in the same run.

1. Local: the wall time of an N-job `cluster=local` sweep on N CPU slots (cluster.max_parallel=N)
   against the slowest of the same N jobs run alone, one after another, with the same threads per
   job. Target: <= 1.1x. The sweep's time is reported twice: until its last job ended (the
   launcher's scheduling overhead) and until the command returned (plus the sweep report).
2. SLURM: the submission latency of an M-job sweep (`cluster=slurm cluster.wait=false`): the time
   until the command returns with every job submitted, minus the time Hydra takes to start and
   compose the same command (`--cfg job`). The submitted jobs are cancelled afterwards.

    python benchmarks/sweep.py                       # N = number of cores, M = 16
    python benchmarks/sweep.py --jobs 2 --steps 300 --slurm-jobs 32
    python benchmarks/sweep.py --skip-slurm          # or --skip-local
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
        "model.num_key_value_heads=2", "model.intermediate_size=128", "model.vocab_size=512",
        "model.max_position_embeddings=64", "data.max_length=64", "data.max_examples=60", "batch_size=4",
        "train.eval_batches=2", "train.eval_steps=100000", "train.save_steps=0"]
REPO = Path(__file__).resolve().parents[1]


def run(args: list[str], cwd: Path, env: dict[str, str], output: list[str] | None = None) -> float:
    """Wall seconds of `python -m llmexp ARGS`; raises if it fails. Appends its output to `output`."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "llmexp", *args], cwd=cwd, env=env, capture_output=True, text=True)
    took_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"python -m llmexp {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    if output is not None:
        output.append(proc.stdout + proc.stderr)
    return took_s


def _log_time(line: str) -> datetime.datetime:
    return datetime.datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")


def launcher_spans_s(log: str) -> tuple[float, float]:
    """From the launcher's log: (first job started -> last job process ended, then -> report written)."""
    lines = log.splitlines()
    started = [_log_time(ln) for ln in lines if " started (pid " in ln]
    ended = [_log_time(ln) for ln in lines if " after " in ln and "(exit " in ln]
    reported = [_log_time(ln) for ln in lines if "Sweep report:" in ln]
    jobs_s = (max(ended) - min(started)).total_seconds()
    return jobs_s, (reported[-1] - max(ended)).total_seconds() if reported else float("nan")


def bench_local(work: Path, env: dict[str, str], num_jobs: int, steps: int) -> None:
    lrs = [f"{1e-3 * (i + 1):.0e}" for i in range(num_jobs)]
    common = [*TINY, f"train.max_steps={steps}"]
    job_env = {**env, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // num_jobs))}
    run([*common, "train.max_steps=2", f"hydra.run.dir={work / 'warmup'}"], work, job_env)  # tokenizer cache
    alone = [run([*common, f"lr={lr}", f"hydra.run.dir={work / f'alone-{lr}'}"], work, job_env) for lr in lrs]
    sweep_dir, output = work / "sweep", []
    total_s = run(["--multirun", *common, f"lr={','.join(lrs)}", f"cluster.max_parallel={num_jobs}",
                   f"hydra.sweep.dir={sweep_dir}"], work, job_env, output)
    jobs_s, report_s = launcher_spans_s(output[0])
    slowest = max(alone)
    print(f"local: {num_jobs} jobs x {steps} steps on {num_jobs} CPU slots "
          f"(OMP_NUM_THREADS={job_env['OMP_NUM_THREADS']})")
    print(f"  jobs alone (whole command): {', '.join(f'{t:.1f} s' for t in alone)} (slowest {slowest:.1f} s)")
    print(f"  sweep, first job start to last job exit: {jobs_s:.1f} s = {jobs_s / slowest:.2f}x the slowest job "
          "(target <= 1.1x)")
    print(f"  whole sweep command:        {total_s:.1f} s = {total_s / slowest:.2f}x "
          f"(of which the sweep report: {report_s:.1f} s)")


def bench_slurm(work: Path, env: dict[str, str], num_jobs: int) -> None:
    if shutil.which("sbatch") is None or subprocess.run(["sinfo", "-h"], capture_output=True).returncode != 0:
        print("slurm: skipped (no cluster; sudo bash launch/slurm-local.sh up)")
        return
    lrs = ",".join(f"{1e-4 * (i + 1):.1e}" for i in range(num_jobs))
    args = ["cluster=slurm", "cluster.wait=false", *TINY, "train.max_steps=5"]
    compose_s = min(run([*args, "lr=1e-4", "--cfg", "job"], work, env) for _ in range(2))
    sweep_dir = work / "slurm-sweep"
    submit_s = run(["--multirun", *args, f"lr={lrs}", f"hydra.sweep.dir={sweep_dir}"], work, env)
    ids = json.loads((sweep_dir / "slurm_jobs.json").read_text())["jobs"]
    subprocess.run(["scancel", ids["0"].split("_")[0]], check=False)
    print(f"slurm: {len(ids)} jobs submitted as one array")
    print(f"  command until it returned:  {submit_s:.2f} s (Hydra start-up and composition alone: {compose_s:.2f} s)")
    print(f"  submission latency:         {submit_s - compose_s:.2f} s "
          f"({(submit_s - compose_s) / len(ids) * 1000:.0f} ms per job)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="local jobs (and CPU slots)")
    parser.add_argument("--steps", type=int, default=400, help="training steps per local job")
    parser.add_argument("--slurm-jobs", type=int, default=16, help="jobs in the SLURM sweep")
    parser.add_argument("--skip-slurm", action="store_true")
    parser.add_argument("--skip-local", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmexp-bench-sweep-") as tmp:
        work = Path(tmp)
        # PYTHONPATH: Hydra's plugin scan cannot see hydra_plugins/ through setuptools' editable hook.
        env = {**os.environ, "LLMEXP_CACHE": os.environ.get("LLMEXP_CACHE", str(work / "cache")),
               "PYTHONPATH": str(REPO), "LLMEXP_NO_BAR": "1"}
        if not args.skip_local:
            bench_local(work, env, args.jobs, args.steps)
        if not args.skip_slurm:
            bench_slurm(work, env, args.slurm_jobs)


if __name__ == "__main__":
    main()
