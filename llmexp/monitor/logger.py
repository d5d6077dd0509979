"""The metrics logger: every record to `metrics.jsonl` (one JSON object per line, flushed, so a killed run
keeps every line it logged), to the console and to the optional sinks. Only rank 0 logs."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from llmexp.monitor.console import (
    format_duration,
    format_line,
    held_warnings_note,
    job_log,
    silence_dead_stdio,
)
from llmexp.monitor.records import Sink
from llmexp.rundir.files import atomic_file
from llmexp.rundir.redact import scrub, secret_env_values

ETA_AFTER_STEPS = 3
"""Steps timed (after the first, which warms up) before the console prints an ETA."""


def safe_exp(x: float) -> float:
    """exp(x) as a JSON-safe float (inf instead of OverflowError)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _json_line(record: dict[str, Any]) -> str:
    """A record as a line of metrics.jsonl. JSON cannot hold NaN/inf: they are written as strings, so a NaN loss
    stays visible."""
    return json.dumps({k: str(v) if isinstance(v, float) and not math.isfinite(v) else v
                       for k, v in record.items()}) + "\n"


class MetricsLogger:
    """Fans each record out to metrics.jsonl, the console and the optional sinks (rank 0 only)."""

    def __init__(self, run_dir: Path, max_steps: int, enabled: bool, sinks: list[Sink] | None = None) -> None:
        self.enabled = enabled
        self.sinks = sinks or []
        self._secrets = secret_env_values()  # no record (nor the history a checkpoint keeps) may hold one
        self.history: list[dict[str, Any]] = []
        self._file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8") if enabled else None  # noqa: SIM115
        self._bar = None
        self.max_steps = max_steps
        self._step_times: list[tuple[float, int]] = []  # (time, steps done) at each advance, for the ETA
        self._steps_done = 0
        self._eta_said = False
        self._job_log: logging.Logger | None = None
        self._own_handler: logging.Handler | None = None
        if enabled:
            from tqdm.auto import tqdm

            self._job_log, self._own_handler = job_log(run_dir)
            self._bar = tqdm(total=max_steps, desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stderr, disable=None if os.environ.get("LLMEXP_NO_BAR") != "1" else True)

    def log(self, record: dict[str, Any]) -> None:
        """Append a record (it must carry `event` and `step`)."""
        record = scrub(record, self._secrets)
        self.history.append(record)
        if not self.enabled:
            return
        assert self._file is not None
        self._file.write(_json_line(record))
        self._file.flush()
        for sink in self.sinks:
            sink.log(record)
        if line := format_line(record):
            eta = self.eta_s() if record["event"] == "train" else None
            self.write(line + (f" | eta {format_duration(eta)}" if eta is not None else ""))

    def reset_history(self, records: list[dict[str, Any]], steps_done: int = 0) -> None:
        """On resume: metrics.jsonl becomes exactly the checkpoint's history (later lines were lost work), and the
        progress and eta count from the checkpoint's step (its history may log none at that step)."""
        self.history = list(records)
        if not self.enabled:
            return
        for sink in self.sinks:  # mlflow continues the run: it must not get those steps twice
            sink.reset(self.history)
        assert self._file is not None
        self._file.close()
        path = Path(self._file.name)
        with atomic_file(path) as f:
            f.writelines(_json_line(r) for r in records)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._steps_done = steps_done
        self._step_times = []
        if self._bar is not None:
            self._bar.n = self._steps_done
            self._bar.refresh()

    def write(self, text: str) -> None:
        """Print above the progress bar, and copy the line to the job log (`llmexp.log`)."""
        if not self.enabled:
            return
        try:
            if self._bar is not None and not self._bar.disable:
                self._bar.write(text, file=sys.stderr)
            else:
                print(text, file=sys.stderr, flush=True)
        except OSError:  # nobody reads the console any more (its launcher was killed, its terminal closed)
            silence_dead_stdio()
        if self._job_log is not None:
            self._job_log.info(text)

    def advance(self, steps: int = 1) -> None:
        """One more optimizer step done; after a few timed steps the console gets one ETA line."""
        if self._bar is not None:
            self._bar.update(steps)
        self._steps_done += steps
        self._step_times.append((time.perf_counter(), self._steps_done))
        if not self._eta_said and (eta := self.eta_s()) is not None:
            self._eta_said = True
            self.write(f"eta {format_duration(eta)} for the {self.max_steps - self._steps_done} remaining steps "
                       f"({self._seconds_per_step():.3g} s/step so far, evals and checkpoints included)")

    def _seconds_per_step(self) -> float:
        """The pace since the first timed step (the first one warms up)."""
        (first_t, first_n), (last_t, last_n) = self._step_times[0], self._step_times[-1]
        return (last_t - first_t) / (last_n - first_n)

    def eta_s(self) -> float | None:
        """Seconds left at `_seconds_per_step`; None until `ETA_AFTER_STEPS` steps are timed, and once no step
        is left (an ETA of 0s says nothing)."""
        if len(self._step_times) <= ETA_AFTER_STEPS or self._steps_done >= self.max_steps:
            return None
        return self._seconds_per_step() * (self.max_steps - self._steps_done)

    def close(self) -> None:
        if (note := held_warnings_note()) is not None:
            self.write(note)
        if self._bar is not None:
            self._bar.close()
        for sink in self.sinks:
            sink.close()
        if self._file is not None:
            self._file.close()
        if self._own_handler is not None and self._job_log is not None:
            self._job_log.removeHandler(self._own_handler)
            self._own_handler.close()
            self._own_handler = None
