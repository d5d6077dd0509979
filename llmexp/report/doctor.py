"""`python -m llmexp.doctor RUN_DIR`: diagnose any run directory after the fact.

Re-runs the health detectors on metrics.jsonl (the same ones the trainer runs live), prints
each finding with the seed's advice, and rewrites report.md and curves.png.
Exit codes: 0 healthy or warnings only, 1 error findings or a failed run, 2 not a run directory.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from llmexp.errors import EXIT_ERROR, EXIT_OK, EXIT_USER
from llmexp.monitor.detectors import is_open
from llmexp.report.findings import finding_state, run_findings
from llmexp.report.run import DAMAGED_SUMMARY, write_run_report
from llmexp.rundir import read
from llmexp.rundir.files import unwritable
from llmexp.rundir.lock import lock_holder

_COLOURS = {"error": "\033[31m", "warning": "\033[33m", "info": "\033[36m", "ok": "\033[32m"}
_RESET, _BOLD = "\033[0m", "\033[1m"


Paint = Callable[[str, str], str]


def _painter(stream: TextIO) -> Paint:
    """Colour text for a terminal; plain text for pipes, files and NO_COLOR."""
    if not stream.isatty() or os.environ.get("NO_COLOR"):
        return lambda text, style: text
    return lambda text, style: f"{_COLOURS.get(style, _BOLD)}{text}{_RESET}"


def format_findings(findings: list[dict], paint: Paint, failed: bool = False) -> str:
    """Findings as readable text: one block per finding, the advice indented under it."""
    if not findings:
        return "No findings in its metrics; its status says how it failed." if failed else \
            paint("No findings: the run looks healthy.", "ok")
    lines = []
    for f in findings:
        label = paint(f"{f['severity'].upper():<7}", f["severity"])
        lines += [f"{label} {f['kind']} at step {f['step']}{finding_state(f)}", f"        {f['message']}",
                  f"        {paint('advice:', 'bold')} {f['advice']}"]
    return "\n".join(lines)


def diagnose_run(run_dir: Path) -> tuple[int, str]:
    """(exit code, text to print) for one run directory; rewrites its report."""
    records = read.load_records(run_dir)
    findings = run_findings(run_dir, records)
    try:
        write_run_report(run_dir, findings)
        wrote = f"wrote {run_dir / 'report.md'}"
    except OSError as err:  # the diagnosis stands without its report
        wrote = f"report.md not written: {unwritable(run_dir, err)}"
    paint = _painter(sys.stdout)
    status, failed = _status(run_dir)
    steps = max((int(r["step"]) for r in records if isinstance(r.get("step"), int)), default=0)  # skipped ones too
    header = f"{paint(str(run_dir), 'bold')}: status {status}, {steps} steps, {len(records)} metric records"
    counts = {s: sum(f["severity"] == s and is_open(f) for f in findings) for s in ("error", "warning", "info")}
    verdict = ", ".join(f"{n} {s}" for s, n in counts.items())
    text = "\n".join([header, format_findings(findings, paint, failed), f"{verdict}; {wrote}"])
    return (EXIT_ERROR if counts["error"] or failed else EXIT_OK), text


def _status(run_dir: Path) -> tuple[str, bool]:
    """(the run's status as the header says it, whether it failed): its process's lock first (a resumed run's
    summary.json still says how its last segment ended), then summary.json, then a sweep job's launcher's verdict
    (a job that failed before writing any summary)."""
    if (holder := lock_holder(run_dir)) is not None:
        return f"running (pid {holder})", False
    summary = read.load_summary(run_dir)
    if read.summary_damaged(run_dir, summary):
        return DAMAGED_SUMMARY, True
    if ended := (summary or {}).get("status"):
        error = summary.get("error") if summary else None
        return f"{ended} ({error})" if error else str(ended), ended in ("failed", "crashed")
    if ended := (job := read.load_job_status(run_dir)).get("status"):
        return f"{ended} ({job.get('error')})", ended in ("failed", "crashed")
    return "no summary.json (killed, or running on another host)", False


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return EXIT_USER
    run_dir = Path(args[0])
    if not run_dir.is_dir() or not read.is_run_dir(run_dir):
        hint = " Give the directory of one run (outputs/<date>/<time>-<pid>), which holds metrics.jsonl."
        if run_dir.is_dir() and read.is_sweep_dir(run_dir):
            hint = (f" It is a sweep directory: use `python -m llmexp.report {run_dir}`, or give one job's directory "
                    f"(e.g. {run_dir / '0'}).")
        print(f"llmexp.doctor: error: {run_dir} is not a run directory (no metrics.jsonl, summary.json "
              f"or .hydra/config.yaml).{hint}", file=sys.stderr)
        return EXIT_USER
    sys.stdout.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]  # (a directory named in bytes)
    code, text = diagnose_run(run_dir)
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
