"""`python -m llmexp.status DIR [--watch [SECONDS]]`: where a run, or every job of a sweep, stands.

One table, local or SLURM, running or ended; what each status means, and the exit codes: docs/reference/commands.md.
It reads only files (the run directories, through `llmexp.rundir.read`) and asks the scheduler: no torch (Hydra only
for its override parser, to read a sweep's record and redact secrets), so it answers in well under a second. Damaged
files are skipped, each said in one line on stderr.
"""

from __future__ import annotations

import argparse
import getpass
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmexp.monitor.console import format_duration
from llmexp.report.formats import is_finite
from llmexp.rundir import read
from llmexp.rundir.lock import LOCK_NAME, lock_holder

SCHEDULER_TIMEOUT_S = 0.7
"""What the scheduler may take to answer (squeue and sacct run side by side); past it the column says `?`."""
WAITING = ("submitted", "queued")
"""Launcher records of a job that has not started (SLURM's `submitted`, the local launcher's `queued`)."""
QUEUED_STATES = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "SUSPENDED")
NEITHER = ("{} is neither a run directory (metrics.jsonl, summary.json, .hydra/) nor a sweep directory (multirun.yaml, "
           "job subdirectories)")
"""The error of `llmexp.status` and `llmexp.report` for a DIR that is neither."""


@dataclass
class Row:
    job: str
    overrides: str
    status: str
    step: int | None = None
    max_steps: int | None = None
    loss: float | None = None
    eval_loss: float | None = None
    best_eval: float | None = None
    eta_s: float | None = None
    slurm_id: str | None = None
    slurm_state: str | None = None


def scheduler_states(job_ids: list[str], timeout_s: float = SCHEDULER_TIMEOUT_S) -> dict[str, str]:
    """SLURM job id -> its state: squeue for queued and running jobs, sacct for the ended ones; `?` when a
    command did not answer in time, '' when neither knows the id; {} without SLURM."""
    if not job_ids or shutil.which("squeue") is None:
        return {}
    commands = [["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", "%i|%T"]]
    if shutil.which("sacct") is not None:
        commands.append(["sacct", "-n", "-P", "-X", "-S", "1970-01-01", "-o", "JobID,State", "-j", ",".join(job_ids)])
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for c in commands]
    deadline, found = time.monotonic() + timeout_s, [{}, {}]
    for i, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            continue
        pairs = (line.strip().partition("|") for line in out.splitlines())
        found[i] = {job_id: state.split()[0] for job_id, _, state in pairs if state}  # `CANCELLED by 0` -> CANCELLED
    live, ended = found  # sacct's RUNNING can lag behind a job that squeue no longer lists: only its final states
    ended = {j: state for j, state in ended.items() if state not in ("RUNNING", "PENDING", *QUEUED_STATES)}
    answered = all(proc.returncode is not None and proc.returncode >= 0 for proc in procs)
    return {j: live.get(j) or ended.get(j) or ("" if answered else "?") for j in job_ids}


def _finite(value: Any) -> float | None:
    return float(value) if is_finite(value) and not isinstance(value, bool) else None


def _eta_s(records: list[dict], step: int | None, max_steps: int | None, run_dir: Path) -> float | None:
    """Seconds left at the pace of the current attempt's last train records, less the time since the last one."""
    starts = [i for i, r in enumerate(records) if r.get("event") in ("start", "resume")]
    timed = [r for r in records[starts[-1] if starts else 0:]
             if r.get("event") == "train" and isinstance(r.get("time_s"), int | float)][-20:]
    if step is None or not max_steps or max_steps <= step or len(timed) < 2 or timed[-1]["step"] <= timed[0]["step"]:
        return None
    per_step = (timed[-1]["time_s"] - timed[0]["time_s"]) / (timed[-1]["step"] - timed[0]["step"])
    try:
        since = time.time() - (run_dir / "metrics.jsonl").stat().st_mtime
    except OSError:
        since = 0.0
    return max(0.0, per_step * (max_steps - step) - since)


def _ended(run_dir: Path, summary: dict | None) -> bool:
    """The run says it ended (a summary with a final status, written after its last record), though its process
    or SLURM job may still be finishing; a later attempt (a rerun, a requeue) rewrites metrics.jsonl after it."""
    if summary is None or summary.get("status") in (None, "preempted"):
        return False
    try:
        return (run_dir / "summary.json").stat().st_mtime >= (run_dir / "metrics.jsonl").stat().st_mtime
    except OSError:
        return True


def _status(run_dir: Path, summary: dict | None, verdict: dict, records: list[dict], state: str | None,
            sweeper: bool) -> str:
    """What the job is doing now, or how it ended (the legend: docs/reference/commands.md)."""
    if verdict.get("status") == "cancelled":  # the launcher's word, final: SLURM may still say RUNNING as it tidies up
        return "cancelled"
    unknown = state in (None, "", "?")  # not on SLURM, or the scheduler said nothing: the lock tells
    if not _ended(run_dir, summary) and (state in ("RUNNING", "COMPLETING")
                                         or (unknown and lock_holder(run_dir) is not None)):
        return "running"
    if state in QUEUED_STATES:
        return "requeued" if records else "queued"
    ended = verdict.get("status")
    if ended and ended not in WAITING:
        return str(ended)
    if summary is not None and summary.get("status"):
        return str(summary["status"])
    if state and (final := read.slurm_end_status(state)):
        return final
    if ended in WAITING:
        return "queued" if sweeper or ended == "submitted" else "not_started"  # (SLURM queues without a sweeper)
    if summary is not None or read.summary_damaged(run_dir, summary):  # there without a status, or unreadable:
        return "failed"  # as the sweep report says
    if records:
        return "killed"
    # A lock left by a process that is gone before its first record: the run stopped as it started (a user's
    # mistake found late, e.g. an empty data file, exits 2 so); where the scheduler could not say, it may yet run.
    return "failed" if state != "?" and (run_dir / LOCK_NAME).exists() else "queued"


def job_row(run_dir: Path, shown: str, slurm_id: str | None, states: dict[str, str], sweeper: bool = True) -> Row:
    """A run directory's line: its files, and the scheduler's word on its SLURM job; `sweeper`: the sweep's
    sweeper is alive."""
    records, summary = read.load_records(run_dir), read.load_summary(run_dir)
    verdict = read.load_job_status(run_dir)
    slurm_id = slurm_id or verdict.get("job_id")
    state = states.get(slurm_id) if slurm_id else None
    status = _status(run_dir, summary, verdict, records, state, sweeper)
    trains = [r for r in records if r.get("event") == "train"]
    evals = [v for r in records if r.get("event") == "eval" and (v := _finite(r.get("eval_loss"))) is not None]
    logged = [trains[-1]["step"] if trains else None, (summary or {}).get("step")]  # (a stop saves past the last log)
    step = max((s for s in logged if isinstance(s, int)), default=None)
    max_steps = next((r for r in reversed(records) if r.get("event") == "start"), {}).get("max_steps")
    return Row(job=run_dir.name, overrides=shown, status=status, step=step, max_steps=max_steps,
               loss=_finite(trains[-1].get("loss")) if trains else None, eval_loss=evals[-1] if evals else None,
               best_eval=min(evals) if evals else None,
               eta_s=_eta_s(records, step, max_steps, run_dir) if status == "running" else None,
               slurm_id=slurm_id, slurm_state=state)


def rows(path: Path, scheduler_timeout_s: float = SCHEDULER_TIMEOUT_S) -> list[Row]:
    """The table's lines for a run directory or a sweep directory, with a line for each job the sweep launched
    whose directory is gone (`rundir.read.launched_jobs`)."""
    path = Path(path)
    sweep = read.is_sweep_dir(path) and not (path / "metrics.jsonl").exists()
    dirs = read.job_dirs(path) if sweep else [path]
    recorded = read.read_slurm_jobs(path / "slurm_jobs.json") or {}
    slurm = {str(k): str(v) for k, v in (recorded.get("jobs") or {}).items()}
    verdict_ids = [str(j) for d in dirs if (j := read.load_job_status(d).get("job_id"))]
    states = scheduler_states(sorted(set(slurm.values()) | set(verdict_ids)), scheduler_timeout_s)
    overrides = {d.name: read.load_overrides(d) for d in dirs}
    gone = {name: job for name, job in (read.launched_jobs(path) if sweep else {}).items() if name not in overrides}
    overrides |= gone
    keys = read.varying_keys(list(overrides.values()), read.swept_keys(path) if sweep else [])
    shown = {name: read.shown_overrides(job, keys) for name, job in overrides.items()}
    sweeper = dirs == [path] or lock_holder(path) is not None
    table = [job_row(d, shown[d.name], slurm.get(d.name), states, sweeper) for d in dirs]
    table += [Row(job=name, overrides=shown[name], status=read.missing_status(path)) for name in gone]
    return sorted(table, key=lambda row: read.job_order(row.job))


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.4g}"


def render(path: Path, table: list[Row], width: int = 160) -> str:
    """The table as text: a heading with the counts per status, then one line per job."""
    slurm = any(r.slurm_id for r in table)
    head = ["job", "overrides", "status", "step", "loss", "eval", "best", "eta"] + (["slurm"] if slurm else [])
    cells = [[r.job, r.overrides or "–", r.status,
              f"{r.step if r.step is not None else '–'}/{r.max_steps if r.max_steps is not None else '–'}",
              _fmt(r.loss), _fmt(r.eval_loss), _fmt(r.best_eval),
              "–" if r.eta_s is None else format_duration(r.eta_s)]
             + ([f"{r.slurm_id or '–'} {r.slurm_state or ''}".strip()] if slurm else []) for r in table]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(head)]
    spare = width - sum(widths) - 2 * (len(widths) - 1)
    if spare < 0 and widths[1] > 12:  # the overrides column gives way on a narrow terminal
        widths[1] = max(12, widths[1] + spare)
    tally = ", ".join(f"{n} {s}" for s, n in Counter(r.status for r in table).items())
    lines = [f"{path}: {len(table)} {'job' if len(table) == 1 else 'jobs'}" + (f" ({tally})" if tally else ""),
             "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    for c in cells:
        c[1] = c[1] if len(c[1]) <= widths[1] else c[1][:widths[1] - 1] + "…"
        lines.append("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmexp.status",
                                     description="Where a run, or every job of a sweep, stands.")
    parser.add_argument("dir", type=Path, help="a run directory or a sweep directory")
    parser.add_argument("--watch", nargs="?", const=2.0, type=float, metavar="SECONDS",
                        help="redraw the table in place every SECONDS (default 2) until Ctrl-C")
    parser.add_argument("--scheduler-timeout", type=float, default=SCHEDULER_TIMEOUT_S, metavar="SECONDS",
                        help=f"how long squeue and sacct may take (default {SCHEDULER_TIMEOUT_S:g}); past it: ?")
    args = parser.parse_args(argv)
    if not all(0 < s <= 86400 for s in (1 if args.watch is None else args.watch, args.scheduler_timeout)):  # (not nan)
        parser.error("--watch and --scheduler-timeout take a number of seconds in (0, 86400]")
    sys.stdout.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]  # (a directory named in bytes)
    if not (read.is_run_dir(args.dir) or read.is_sweep_dir(args.dir)):
        print(f"llmexp.status: error: {NEITHER.format(args.dir)}", file=sys.stderr)
        return 2
    width = shutil.get_terminal_size((160, 24)).columns
    if args.watch is None:
        print(render(args.dir, rows(args.dir, args.scheduler_timeout), width))
        return 0
    tty, first = sys.stdout.isatty(), True
    # Ctrl-C stops a watch even where this process was started with SIGINT ignored (a background job of a script,
    # a pytest-xdist worker's child): Python keeps an inherited SIG_IGN, and the watch would never end.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            frame = (f"{render(args.dir, rows(args.dir, args.scheduler_timeout), width)}\n"
                     f"(every {args.watch:g} s, {time.strftime('%H:%M:%S')}; Ctrl-C stops)")
            if tty:  # in place: home (the first time, clear the screen), each line cleared to its end, then below
                frame = ("\x1b[2J" if first else "") + "\x1b[H" + frame.replace("\n", "\x1b[K\n") + "\x1b[K\n\x1b[J"
            print(frame if tty else frame + "\n\n", end="", flush=True)
            first = False
            time.sleep(max(0.1, args.watch))
    except KeyboardInterrupt:
        return 0
