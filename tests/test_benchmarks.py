"""The benchmarks' quick modes: each runs end to end here, and its table states facts that must hold
whatever the machine's size or speed (no timing asserts)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import REPO

ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}


def test_every_name_a_benchmark_imports_from_llmexp_exists() -> None:
    """A benchmark that is not run here still imports what it needs: a name llmexp drops or moves fails now, not
    on the day someone runs that benchmark (benchmarks/lr_finder.py imported a table llmexp no longer had)."""
    missing = []
    for path in sorted((REPO / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmexp"):
                module = importlib.import_module(node.module)
                names = [a.name for a in node.names if not hasattr(module, a.name)]  # (or a submodule of it)
                missing += [f"{path.relative_to(REPO)}:{node.lineno} {node.module}.{name}" for name in names
                            if not (hasattr(module, "__path__") and importlib.util.find_spec(f"{node.module}.{name}"))]
    assert not missing, missing


def last_json(stdout: str) -> dict[str, Any]:
    return next(json.loads(line) for line in reversed(stdout.splitlines()) if line.startswith("{"))


@pytest.mark.slow  # ~30 s: three fresh processes import datasets/transformers, and a BPE is trained
def test_data_hf_quick_both_sides_produce_the_same_tokens() -> None:
    """benchmarks/data_hf.py --quick: llmexp's data=hf packs exactly the tokens datasets.map's run_clm
    recipe produces for the same text and tokenizer, blocks differ only by dropped tails, and the
    speed-up is a positive finite number."""
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "data_hf.py"), "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert facts["same_tokens"] and facts["same_token_count"] and facts["llmexp_tail_only"], facts
    assert facts["blocks_differ_by_tails_only"], facts
    assert math.isfinite(facts["speedup"]) and facts["speedup"] > 0, facts
    (run,) = facts["rounds"]
    assert run["llmexp"]["blocks"] > 0 and run["llmexp"]["tokens"] == run["hf"]["tokens"] > 0, run
    assert "| `datasets.map` (run_clm.py recipe" in result.stdout  # the table is printed, and written nowhere
