"""How an llmexp process uses Python's garbage collector: from its start (`tune_collector`) to its end
(`settle_for_exit`). Every process entry calls both: the CLI's (`llmexp.cli.main.run_entry`) and a sweep's job
in a fresh process or on SLURM. `benchmarks/exit_cpu.py` measures what they save."""

from __future__ import annotations

import gc

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
