"""A run's process CPU, whole and after its last line, through llmexp's process entry or without its GC settings.

    python benchmarks/exit_cpu.py                  # 4 rounds of both arms, a tiny default run each
    python benchmarks/exit_cpu.py --rounds 1 --out ''

At exit CPython runs full garbage collections over every object the process holds; with torch and transformers
loaded that is over a second of CPU, spent for nothing, at the end of every run and every sweep job; and while
they are imported, a collection every 700 new objects re-scans the ones already made. llmexp's process entry
(`llmexp.process.run_entry`) raises the collection thresholds and freezes the objects before
the exit (`settle_for_exit`). Both arms are the same tiny run (llmexp/conf/model/tiny.yaml, 2 steps) through
`llmexp.cli.main`: `cli` (neither) and `main` (the entry). Each child reports its CPU seconds at its last atexit
handler; the parent reads the child's whole CPU from `os.wait4`: the difference is the exit's. Arms alternate;
ratios are paired per round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, REPO, load_average, machine, markdown_table, publish, rotated, utc_now

ARMS = ("cli", "main")
CHILD = """
import atexit, os, resource, sys
def report():  # registered first, so it runs last of the atexit handlers: just before finalization
    r = resource.getrusage(resource.RUSAGE_SELF)
    print(f"CPU_AT_EXIT {r.ru_utime + r.ru_stime}", file=sys.stderr)
atexit.register(report)
import llmexp.cli.main as entry
sys.argv = ["llmexp", *sys.argv[1:]]
getattr(entry, os.environ["EXIT_ARM"])()
"""
RUN = ["model=tiny", "train.max_steps=2", "train.eval_steps=2", "train.eval_batches=2", "data.max_examples=60"]


def process_cpu_s(arm: str, work: Path) -> tuple[float, float]:
    """(the child's whole CPU seconds, those after its atexit handlers ran: the interpreter's finalization)."""
    run_dir = work / f"{arm}-{len(list(work.iterdir()))}"
    env = {**os.environ, "EXIT_ARM": arm, "PYTHONPATH": str(REPO)}
    err_path = work / f"{run_dir.name}.err"
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen([PY, "-c", CHILD, *RUN, f"hydra.run.dir={run_dir}"], env=env,
                                stdout=subprocess.DEVNULL, stderr=err_file)
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own CPU, which Popen.wait does not give
    err = err_path.read_text()
    line = next((ln for ln in err.splitlines() if ln.startswith("CPU_AT_EXIT")), None)
    if os.waitstatus_to_exitcode(status) != 0 or line is None:
        raise SystemExit(f"the {arm} arm exited {os.waitstatus_to_exitcode(status)}:\n{err[-3000:]}")
    total = usage.ru_utime + usage.ru_stime
    return total, total - float(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default="exit_cpu.md", help="file under benchmarks/results ('' for none)")
    args = parser.parse_args()
    started, load_start = utc_now(), load_average()
    whole: dict[str, list[float]] = {arm: [] for arm in ARMS}
    at_exit: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="llmexp-exit-") as tmp:
        for round_index in range(args.rounds):
            for arm in rotated(list(ARMS), round_index):
                total, exiting = process_cpu_s(arm, Path(tmp))
                whole[arm].append(total)
                at_exit[arm].append(exiting)
                print(f"round {round_index + 1}: {arm} {total:.2f} s of CPU, {exiting:.2f} s at exit", file=sys.stderr)
    med = statistics.median
    rows = [[arm, f"{med(whole[arm]):.2f}", f"{med(at_exit[arm]):.2f}",
             " / ".join(f"{t:.2f} ({e:.2f})" for t, e in zip(whole[arm], at_exit[arm], strict=True))] for arm in ARMS]
    paired = [m / c for c, m in zip(whole["cli"], whole["main"], strict=True)]
    text = "\n".join([
        "# A run's process CPU: llmexp's process entry against none", "",
        f"Measured {started} on {machine()}; load average {load_start} at the start, {load_average()} at the end. "
        f"A tiny default run (2 steps), {args.rounds} rounds, arms alternating.", "",
        markdown_table(["entry", "CPU s (median)", "of it at exit (median)", "each round: all (at exit)"], rows), "",
        f"- `main` / `cli`: {med(paired):.2f}x the process's CPU (median of {len(paired)} paired rounds), "
        f"{med(whole['cli']) - med(whole['main']):.2f} s saved a process, "
        f"{med(at_exit['cli']) - med(at_exit['main']):.2f} s of it at exit"])
    publish(text, args.out)


if __name__ == "__main__":
    main()
