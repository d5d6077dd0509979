"""How an llmexp process uses Python's garbage collector: from its start (`tune_collector`) to its end
(`settle_for_exit`). Every process entry calls both, through `run_entry` (the CLI's commands, a sweep's job in a
fresh process) or on its own (a SLURM job, inside submitit's process). `benchmarks/exit_cpu.py` measures what they
save."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import NoReturn

GC_THRESHOLDS = (10_000, 10, 10)
"""The process's garbage-collection thresholds (CPython's default: 700, 10, 10). Importing torch and transformers
makes millions of objects, and at the default a collection ran every 700 of them, re-scanning the ones already made:
~0.8 s of CPU a process (2-core AMD EPYC). A training step makes few Python objects, so memory does not notice."""


def tune_collector() -> None:
    """Called as the process starts, before torch is imported: `GC_THRESHOLDS`."""
    gc.set_threshold(*GC_THRESHOLDS)


def settle_for_exit() -> None:
    """Called as the process ends. CPython's finalization then runs several full garbage collections over every
    object the process holds: with torch and transformers loaded, over a second of CPU at the end of every run,
    for nothing (a tiny run's exit: 1.66 s of CPU, 0.20 s with this; 2-core AMD EPYC). Freezing them (`gc.freeze`)
    leaves them out of those collections; atexit handlers and module teardown run as before."""
    gc.freeze()


def run_entry(command: Callable[[], int | None]) -> NoReturn:
    """A process entry that imports torch: `command` with the collector tuned for it, exiting with its code; however
    it ends, settled for the exit first."""
    tune_collector()
    try:
        sys.exit(command())
    finally:
        settle_for_exit()
