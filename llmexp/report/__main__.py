"""`python -m llmexp.report DIR`: (re)write a run's report or a sweep's report, whichever DIR is. What it writes
and its exit codes (a sweep's own: `rundir.read.sweep_exit_code`): docs/reference/commands.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from llmexp.report.run import write_run_report
from llmexp.report.status import NEITHER
from llmexp.report.sweep import write_sweep_report
from llmexp.rundir import read
from llmexp.rundir.files import unwritable


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: python -m llmexp.report RUN_DIR|SWEEP_DIR", file=sys.stderr)
        return 2
    path = Path(args[0])
    sys.stdout.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]  # (a directory named in bytes)
    try:
        if read.is_sweep_dir(path) and not (path / "metrics.jsonl").exists():
            summary = write_sweep_report(path)
            rec = summary["recommendation"]
            print(f"wrote {path / 'sweep_report.md'}: {summary['num_jobs']} jobs {summary['status_counts']}")
            print(f"recommended: {rec['settings']} ({rec['reason']})" if rec else "no recommendation")
            return read.sweep_exit_code([read.read_result(Path(j["dir"]), j["metric"]) for j in summary["jobs"]])
        if read.is_run_dir(path):
            write_run_report(path)
            print(f"wrote {path / 'report.md'} and {path / 'curves.png'}")
            return 0
    except OSError as err:
        print(f"llmexp.report: error: {unwritable(path, err)}", file=sys.stderr)
        return 1
    print(f"llmexp.report: error: {NEITHER.format(path)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
