"""In a search sweep's job: report `sweep.metric` at each eval to the study and ask the pruner whether to stop.
The trial asks in its own process, so that it stops exactly at the eval that condemned it, as a preemption stops
(a checkpoint, then status `pruned`), and a sweeper killed meanwhile loses none of its reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from llmexp.errors import UserError
from llmexp.rundir.study import SEARCHES, load_study, make_pruner
from llmexp.rundir.task_metrics import metric_at


@dataclass
class TrialPruning:
    """The study and this job's trial in it; `None` (see `for_job`) outside a search with a pruner."""

    study: Any
    trial: Any

    @classmethod
    def for_job(cls, cfg: DictConfig, is_main: bool) -> TrialPruning | None:
        """This job's trial when it is one of a search's (`sweep=random|tpe`, `sweep.pruner` not none) and this
        is the first rank (the others follow its verdict); else None."""
        hydra = HydraConfig.get()
        if not is_main or cfg.sweep.name not in SEARCHES or cfg.sweep.pruner == "none" \
                or hydra.mode != RunMode.MULTIRUN:
            return None
        import optuna

        pruner = make_pruner(cfg.sweep.pruner, cfg.train.eval_steps, cfg.train.max_steps)
        study = load_study(Path(hydra.sweep.dir), pruner)
        # optuna looks trials up by id; the storage's number-to-id call is public, the study's id is not
        trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, int(hydra.job.num))
        return cls(study, optuna.trial.Trial(study, trial_id))

    def should_stop(self, step: int, value: float) -> bool:
        """Report `sweep.metric` at the eval of `step` (step 0, the untrained model, says nothing: it is not
        reported) and ask the pruner, which knows the study's direction. A non-finite value is left to the
        doctor and the anomaly policy."""
        if step == 0 or not math.isfinite(value):
            return False
        if step not in self.trial.study.trials[self.trial.number].intermediate_values:  # resumed: reported already
            self.trial.report(value, step)
        return self.trial.should_prune()

    def reason(self, step: int) -> str:
        return f"pruned by the sweeper's {type(self.study.pruner).__name__} after the eval at step {step}"


def sweep_value(cfg: DictConfig, eval_record: dict[str, Any], task_records: list[dict[str, Any]]) -> float:
    """`sweep.metric` at this eval, on rank 0 (NaN when not finite: the pruner leaves it be). Validation knows
    every metric but a harness task's: one the harness does not record is the user's mistake, found at the
    first eval (exit 2, naming what the evals record)."""
    value = metric_at(str(cfg.sweep.metric), eval_record, task_records)
    if value is None:
        offered = ", ".join(f"tasks/{r['task']}/{m}" for r in task_records for m in r["metrics"])
        raise UserError(f"sweep.metric={cfg.sweep.metric}: the evals do not record it; they record eval_loss, "
                        f"eval_ppl{', ' + offered if offered else ''}; set sweep.metric to one of them")
    return value if math.isfinite(value) else math.nan
