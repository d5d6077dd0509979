"""Paces training for the SLURM timeout test (tests/test_slurm.py), in every Python process started with this
folder first on PYTHONPATH: a pause of LLMEXP_TEST_STEP_PAUSE_S seconds after each optimizer step of the plain
engine. SLURM's clock counts minutes, so the job must train for minutes to reach its time limit; paced, those
minutes cost a fraction of the CPU that other tests need, and the job's speed depends little on what else the
machine runs, so the speed measured as the test starts still holds when the job trains. Only the pace changes:
the steps, their numbers and the signals are the real ones. The engine is wrapped as it is imported (an import
hook), so nothing is imported early and processes that never train are not touched.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time
from types import ModuleType
from typing import Any

TARGET = "llmexp.train.engines.plain"


class _PaceOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # found once, by the finders after this one
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            _pace(module.PlainEngine, float(os.environ["LLMEXP_TEST_STEP_PAUSE_S"]))

        spec.loader.exec_module = exec_module
        return spec


def _pace(engine: type, pause_s: float) -> None:
    step = engine.step

    def paced_step(self: Any, optimizer: Any) -> bool:
        stepped = step(self, optimizer)
        time.sleep(pause_s)
        return stepped

    engine.step = paced_step


if os.environ.get("LLMEXP_TEST_STEP_PAUSE_S"):
    sys.meta_path.insert(0, _PaceOnImport())
