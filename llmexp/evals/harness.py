"""lm-evaluation-harness tasks by name (`eval.lm_eval.tasks`), on the in-memory model, through the harness's
Python API: `lm_eval.models.huggingface.HFLM(pretrained=<the model>)` and `lm_eval.simple_evaluate`.

An optional extra (`pip install llmexp[eval]`), imported only when a run names harness tasks; offline use:
docs/how-to/evals.md ("lm-evaluation-harness is an optional extra"). The harness seeds python's, numpy's and torch's
global RNGs unless told not to, which would change the training that follows: it is told not to (every seed None),
and runs inside a forked RNG all the same.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from llmexp.errors import UserError, first_line

INSTALL_HINT = "pip install 'llmexp[eval]' (or pip install lm-eval)"


def require_harness() -> None:
    """A UserError with the install command when lm-eval is not installed."""
    if importlib.util.find_spec("lm_eval") is None:
        raise UserError(f"eval.lm_eval.tasks needs lm-evaluation-harness, which is not installed: {INSTALL_HINT}")


def task_manager(include_path: str | None, include_defaults: bool) -> Any:
    """The harness's task index: the built-in tasks and/or a directory of task YAMLs."""
    require_harness()
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm-eval").setLevel(logging.WARNING)  # its INFO lines are one per task and request
    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def check_tasks(manager: Any, names: list[str], include_path: str | None, include_defaults: bool) -> None:
    """Every named task is one the index knows; else a UserError naming it and where the harness looked."""
    known = set(manager.all_tasks)
    missing = [n for n in names if n not in known]
    if missing:
        where = " and ".join([*([include_path] if include_path else []),
                              *(["the built-in tasks"] if include_defaults else [])])
        raise UserError(f"eval.lm_eval.tasks: {', '.join(missing)} not found in {where}; check the names "
                        "(lm-eval ls tasks), or set eval.lm_eval.include_path to a directory of task YAMLs")


def check_task_data(manager: Any, names: list[str]) -> None:
    """Each task built once as the run starts, which loads its data: a task YAML whose data file is missing or
    malformed is the user's to fix (exit 2, before the first step), not a traceback at the first eval."""
    from datasets.exceptions import DatasetGenerationError
    from lm_eval.tasks import get_task_dict

    try:
        get_task_dict(names, manager)
    except (OSError, ValueError, DatasetGenerationError) as err:
        raise UserError(f"eval.lm_eval.tasks={','.join(names)}: the harness cannot load their data "
                        f"({type(err).__name__}: {first_line(err, 300)}); check each task YAML's dataset_path and "
                        "dataset_kwargs (data_files)") from None


def check_before_start(lm: Any) -> None:
    """`eval.lm_eval` before anything is written: the harness installed and, when only `include_path` is indexed
    (seconds), every task named there. The built-in index takes ~25 s to build, so with `include_defaults` the
    names are checked as the run starts, before its first step."""
    if not lm.tasks:
        return
    require_harness()
    if not lm.include_defaults:
        check_tasks(task_manager(lm.include_path, False), list(lm.tasks), lm.include_path, False)


def evaluate(lm: Any, tokenizer: Any, manager: Any, names: list[str], *, batch_size: int, max_length: int,
             limit: int | None, num_fewshot: int | None, device: Any) -> dict[str, tuple[dict[str, float], int]]:
    """{task: ({metric: value}, items scored)} of the harness on the in-memory model (its numbers; stderr left out)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from llmexp.model.rng import eval_mode, rng_untouched

    with eval_mode(lm), rng_untouched(device):
        model = HFLM(pretrained=lm, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
        out = simple_evaluate(model=model, tasks=list(names), task_manager=manager, limit=limit,
                              num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=0, random_seed=None,
                              numpy_random_seed=None, torch_random_seed=None, fewshot_random_seed=0)
    counts = (out or {}).get("n-samples", {})
    return {task: (metrics, int(counts.get(task, {}).get("effective", 0)))
            for task, metrics in metrics_of(out["results"] if out else {}).items()}


def metrics_of(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The harness's `results` as {task: {metric: value}}: `acc,none` -> `acc`, `exact_match,strict-match` ->
    `exact_match_strict-match`; stderr and non-numbers left out."""
    out: dict[str, dict[str, float]] = {}
    for task, values in results.items():
        out[task] = {}
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if number and filt and not metric.endswith("_stderr"):
                out[task][metric if filt == "none" else f"{metric}_{filt}"] = float(value)
    return out
