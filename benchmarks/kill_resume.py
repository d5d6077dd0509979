"""Kill -9 a real training run N times at random points, resume each time, and check the result.

    python benchmarks/kill_resume.py                 # 20 kills, fp32, accumulation 2
    python benchmarks/kill_resume.py --kills 20 --precision fp16 --accum 4 --seed 7

The kills are spread over chains (a chain: run, kill, resume, kill, ..., finish). The first
kill of a chain lands at an exact random point inside the process (before a random micro-batch
backward, or right after a random checkpoint file was written); the rest land from outside at a
random moment after a random later step was logged (or, once the last step is logged, at a
random moment of the restart: loading, resuming, the final save or the report). Every chain's
final metrics and weights are compared bitwise with an uninterrupted run made in the same
invocation. Prints one line per kill, then the totals; exits 1 if any chain differs.

Uses the harness in tests/test_resume.py (the same code the test suite runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
FILES_PER_SAVE = 3  # model.safetensors, optimizer.pt, rng_rank0.pt (+ scaler.pt under fp16)


def _harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("test_resume", REPO / "tests" / "test_resume.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def _first_kill(h: ModuleType, rng: random.Random, accum: int, fp16: bool) -> object:
    """An exact kill from inside a fresh run: a random backward call or checkpoint file."""
    if rng.random() < 0.6:
        return h.Kill(hook=f"backward:{rng.randint(1, accum * (h.MAX_STEPS - 1))}")
    saves = (h.MAX_STEPS - 1) // 3  # train.save_steps=3 in the harness
    return h.Kill(hook=f"ckpt_file:{rng.randint(1, (FILES_PER_SAVE + fp16) * saves)}")


def _progress(h: ModuleType, run_dir: Path) -> tuple[int, int]:
    """(last step logged, newest complete checkpoint step) at the moment of a kill."""
    from llmexp.checkpoint.store import list_checkpoints

    steps = h._train_steps(run_dir)
    found = list_checkpoints(run_dir / "checkpoints")
    return (max(steps) if steps else 0), (int(found[-1].name.split("_")[1]) if found else 0)


def _next_kill(h: ModuleType, rng: random.Random, last_step: int) -> object:
    """An outside kill at a random later step; once the run has logged its last step, at a
    random moment of the next start (loading, resuming, the final save, the report)."""
    if last_step < h.MAX_STEPS:
        return h.Kill(at_step=rng.randint(last_step + 1, h.MAX_STEPS), jitter_s=0.5)
    return h.Kill(at_step=h.MAX_STEPS, jitter_s=8.0)


def run_chain(h: ModuleType, run_dir: Path, overrides: tuple[str, ...], env: dict[str, str], first: object,
              count: int, rng: random.Random, rows: list[dict]) -> bool:
    """One chain: `first`, then `count - 1` random kills, each followed by a resume; appends a
    row per kill; True if the finished run is bitwise equal to the reference."""
    kill = first
    for _ in range(count):
        started = time.perf_counter()
        code, out = h.run_once(run_dir, overrides, env, kill, rng)
        last_step, newest = _progress(h, run_dir)
        label = kill.hook or (f"step>={kill.at_step}+{kill.jitter_s:g}s" if kill.jitter_s < 8 else "in a restart")
        rows.append({"chain": run_dir.parent.name, "kill": label, "landed": code == -9, "last_step": last_step,
                     "resume_from": newest, "run_s": time.perf_counter() - started})
        if code != -9:
            print(f"  kill {kill} did not land (exit {code}):\n{out[-2000:]}", file=sys.stderr)
        kill = _next_kill(h, rng, last_step)
    code, out = h.run_once(run_dir, overrides, env)
    if code != 0:
        print(f"  final run failed (exit {code}):\n{out[-2000:]}", file=sys.stderr)
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--per-chain", type=int, default=4, help="kills per chain (run, kill, resume, ...)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--accum", type=int, default=2, help="train.gradient_accumulation_steps")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    # SIGTERM: unwind (run_once's `finally` kills the training child, the temp dir is removed).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    rng = random.Random(seed)
    h = _harness()
    overrides = (f"precision={args.precision}", f"train.gradient_accumulation_steps={args.accum}")
    if args.precision == "fp16":
        overrides += ("precision.growth_interval=2",)
    with tempfile.TemporaryDirectory(prefix="kill_resume-") as tmp:
        work = args.workdir or Path(tmp)
        env = h.cli_env(work / "cache")
        print(f"seed {seed}; {' '.join(overrides)}; {args.kills} kills in chains of {args.per_chain}")
        references = []
        for name in ("warmup", "reference"):  # the first also builds the tokenizer and token cache
            started = time.perf_counter()
            code, out = h.run_once(_fresh(work / name / "run"), overrides, env)
            if code != 0:
                print(out[-3000:], file=sys.stderr)
                return 1
            reference_s = time.perf_counter() - started
            references.append(h.fingerprint(work / name / "run"))
        reference = references[-1]
        deterministic = references[0] == reference
        print(f"  two uninterrupted runs bitwise equal to each other: {deterministic}")
        rows: list[dict] = []
        chains_equal, chain_s = [], []
        for c in range((args.kills + args.per_chain - 1) // args.per_chain):
            count = min(args.per_chain, args.kills - c * args.per_chain)
            first = _first_kill(h, rng, args.accum, args.precision == "fp16")
            run_dir = _fresh(work / f"chain{c}" / "run")
            t0 = time.perf_counter()
            ok = run_chain(h, run_dir, overrides, env, first, count, rng, rows) and h.fingerprint(run_dir) == reference
            chain_s.append(time.perf_counter() - t0)
            chains_equal.append(ok)
            for row in rows[-count:]:
                print(f"  {row['chain']:>7}  kill {row['kill']:<16} landed={row['landed']!s:<5} "
                      f"last step {row['last_step']:>2}  newest checkpoint {row['resume_from']:>2}  "
                      f"({row['run_s']:.1f} s)")
            print(f"  {'chain' + str(c):>7}  final metrics and weights bitwise equal to the reference: {ok}")
        _report(rows, chains_equal, chain_s, reference_s)
        return 0 if deterministic and all(chains_equal) and all(r["landed"] for r in rows) else 1


def _fresh(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _report(rows: list[dict], chains_equal: list[bool], chain_s: list[float], reference_s: float) -> None:
    landed = sum(r["landed"] for r in rows)
    redone = [r["last_step"] - r["resume_from"] for r in rows if r["landed"]]
    mean_chain = sum(chain_s) / len(chain_s)
    print(json.dumps({
        "kills": len(rows), "kills_landed": landed,
        "chains_bitwise_equal": f"{sum(chains_equal)}/{len(chains_equal)}",
        "steps_redone_per_kill_mean": round(sum(redone) / max(1, len(redone)), 2),
        "reference_run_s": round(reference_s, 1),
        "chain_time_vs_reference": round(mean_chain / reference_s, 2),
    }, indent=1))


if __name__ == "__main__":
    sys.exit(main())
