"""OUT/gpu.json and OUT/gpu.md of the GPU check, rewritten by benchmarks/gpu/run.sh after every step:

    python benchmarks/gpu/report.py init   OUT WORK --mode gpu --budgets '{"install": 20, "1": 65, ...}'
    python benchmarks/gpu/report.py start  OUT WORK --step N
    python benchmarks/gpu/report.py record OUT WORK --step N --rc RC --seconds S --budget B --log LOG
    python benchmarks/gpu/report.py skip   OUT WORK --step N --reason TEXT
    python benchmarks/gpu/report.py finish OUT WORK --elapsed S     (every command takes --elapsed)

A step's status: ok (exit 0), timed_out (124 or 137: its budget ran out; the figures so far are kept), failed
(any other exit: the log's tail is the error), skipped (no time left), running (started, never recorded: the
run was cut short during it). Standard library only; the machine's facts come from nvidia-smi and one
`python -c 'import torch'`. Every figure but the GPU's absolutes (tokens/s, MFU, peak memory) is a ratio
measured side by side in this run; the absolutes belong to the card named at the top.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from steps import STEPS  # the titles (steps.py imports the standard library only)

PACKAGES = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "hydra-core", "omegaconf", "tokenizers",
            "safetensors", "numpy")
TORCH_FACTS = ("import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
               "'cuda': torch.version.cuda, 'cuda_available': c, "
               "'device': torch.cuda.get_device_name(0) if c else None, 'device_count': torch.cuda.device_count()}))")
TITLES = {"install": "Install the carried wheels (no network)", **{str(k): t for k, (t, _) in STEPS.items()}}
TAIL = 2500


def machine(mode: str) -> dict[str, Any]:
    """The card, the driver, the date, the versions: what every absolute figure is reported with."""
    facts: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "mode": mode,
                             "python": platform.python_version(), "cpus": os.cpu_count(),
                             "cpu": cpu_model()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        facts["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()[:300]
    except (OSError, subprocess.TimeoutExpired) as err:
        facts["nvidia_smi"] = f"not run: {err}"
    try:
        torch = subprocess.run([sys.executable, "-c", TORCH_FACTS], capture_output=True, text=True, timeout=120)
        facts.update(json.loads(torch.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as err:
        facts["torch"] = f"unknown: {err}"
    facts["packages"] = {name: version_of(name) for name in PACKAGES}
    return facts


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")


def version_of(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------- gpu.json


def load(out: Path) -> dict[str, Any]:
    return json.loads((out / "gpu.json").read_text())


def save(out: Path, work: Path, report: dict[str, Any]) -> None:
    """Both files, each written whole and then moved into place (a reader never sees half of one)."""
    for name, text in (("gpu.json", json.dumps(report, indent=1, default=str)), ("gpu.md", render(report, work))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text + "\n")
        tmp.replace(out / name)


def step_record(work: Path, step: str) -> dict[str, Any]:
    path = work / "steps" / f"{step}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def status_of(rc: int) -> str:
    return "ok" if rc == 0 else "timed_out" if rc in (124, 137) else "failed"


def log_tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-TAIL:]
    except OSError:
        return ""


# ---------------------------------------------------------------- gpu.md


def render(report: dict[str, Any], work: Path) -> str:
    m = report["machine"]
    lines = [
        "# The GPU check (`benchmarks/gpu/run.sh`)", "",
        f"{m['date']}; mode {m['mode']}; card: {m.get('nvidia_smi') or 'none'} (nvidia-smi: name, driver, memory); "
        f"torch {m.get('torch')} (CUDA {m.get('cuda')}, {m.get('device') or 'no GPU'}); Python {m['python']}; "
        f"{m['cpus']} CPUs ({m['cpu']}); " + ", ".join(f"{k} {v}" for k, v in m["packages"].items() if v) + ".",
        f"Elapsed {report.get('elapsed_s', '…')} s of the {report['total_budget_s']} s budget, the install included.",
        "Every ratio is measured side by side in this run; tokens/s, MFU and peak memory are this card's absolutes.",
        "", "| step | what | status | seconds (budget) | result |", "|---|---|---|---|---|",
    ]
    order = ["install", *[k for k in report["budget_s"] if k != "install"]]
    for key in order:
        s = report["steps"].get(key)
        if s is None:
            continue
        lines.append(f"| {key} | {s.get('title', TITLES.get(key, ''))} | {s['status']} | "
                     f"{s.get('seconds', '–')} ({report['budget_s'].get(key, '–')}) | {s.get('verdict', '')} |")
    for key in order:
        s = report["steps"].get(key)
        if s is None or key == "install":
            continue
        lines += ["", f"## {key}. {s.get('title', '')}", "", f"Status: {s['status']}."]
        if s.get("lines"):
            lines += ["", *s["lines"]]
        if s.get("sub_runs"):
            lines += ["", seconds_line(s["sub_runs"])]
        if s.get("error"):
            lines += ["", "Error (the log's tail):", "", "```", s["error"].strip(), "```"]
    return "\n".join(lines)


def seconds_line(sub_runs: dict[str, dict[str, Any]]) -> str:
    """Where the step's seconds went, sub-run by sub-run: what the next resizing of the budgets reads."""
    def one(name: str, t: dict[str, Any]) -> str:
        wall, imports, setup, run = (t.get(k) for k in ("wall_s", "imports_s", "setup_s", "run_s"))
        if None in (imports, setup, run):
            return f"{name} {wall}"
        return (f"{name} {wall} (imports {imports:.1f}, set-up {setup:.1f}, steps and end {run - setup:.1f}, "
                f"the rest {wall - imports - run:.1f})")

    return ("Seconds per sub-run (wall; an llmexp run's imports, set-up, steps and end, and the rest: the "
            "interpreter, Hydra, the exit): " + "; ".join(one(name, t) for name, t in sub_runs.items()) + ".")


# ---------------------------------------------------------------- the commands


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["init", "start", "record", "skip", "finish"])
    parser.add_argument("out", type=Path)
    parser.add_argument("work", type=Path)
    parser.add_argument("--mode", default="gpu")
    parser.add_argument("--budgets", default="{}")
    parser.add_argument("--step")
    parser.add_argument("--rc", type=int)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--budget", type=float)
    parser.add_argument("--log", type=Path)
    parser.add_argument("--reason", default="")
    parser.add_argument("--elapsed", type=float, help="seconds since run.sh started")
    return parser.parse_args(argv)


def recorded(args: argparse.Namespace) -> dict[str, Any]:
    """A finished step's entry: its status from the exit code, what it saved, the log's tail if it failed."""
    found = step_record(args.work, args.step)
    entry = {"status": status_of(args.rc), "rc": args.rc, "seconds": round(args.seconds, 1), "budget_s": args.budget,
             "title": found.get("title", TITLES.get(args.step, "")), "verdict": found.get("verdict", ""),
             "figures": found.get("figures", {}), "lines": found.get("lines", []), "sub_runs": found.get("seconds", {})}
    if args.rc != 0:
        entry["error"] = log_tail(args.log) if args.log else ""
        entry["verdict"] = entry["verdict"] or entry["status"]
    return entry


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.command == "init":
        budgets = json.loads(args.budgets)
        report = {"kit": "benchmarks/gpu/run.sh", "machine": machine(args.mode), "budget_s": budgets,
                  "total_budget_s": sum(budgets.values()), "work": str(args.work), "steps": {}, "events": []}
    else:
        report = load(args.out)
    title = TITLES.get(args.step or "", "")
    if args.command == "start":
        report["steps"][args.step] = {"status": "running", "title": title}
    elif args.command == "record":
        report["steps"][args.step] = recorded(args)
    elif args.command == "skip":
        report["steps"][args.step] = {"status": "skipped", "title": title, "verdict": args.reason}
    elif args.command == "finish":
        report["finished"] = True
    if args.elapsed is not None:
        report["elapsed_s"] = round(args.elapsed, 1)
    # the events show that both files were written after each of them (a run cut short still reports)
    report["events"].append({"event": args.command, "step": args.step, "elapsed_s": args.elapsed})
    save(args.out, args.work, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
