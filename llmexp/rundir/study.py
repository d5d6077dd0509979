"""A search's optuna study as every layer meets it: where it is stored, and its pruner.

The sweeper (`llmexp.sweep.search`) asks and tells; each trial's trainer reports its evals and asks
whether to stop (`llmexp.train.pruning`), in its own process, on whatever node it runs; the report
reads it. All three open the same file (`study_journal`) and build the pruner from the
same config keys, so a trial needs nothing from the sweeper but its config. optuna is imported in
the functions only: `--help` never pays for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

STUDY_NAME = "llmexp"
"""The optuna study's name inside `study_journal`."""

SEARCHES = ("random", "tpe")
"""`sweep.name`s that are optuna searches (`grid` is Hydra's grid)."""


def study_journal(sweep_dir: Path) -> Path:
    """Where an optuna search keeps its study (`sweep=random|tpe`): an optuna JournalStorage file, study
    name `STUDY_NAME`, safe on a shared filesystem. Trial number N is the sweep's job N (`SWEEP_DIR/N`)."""
    return Path(sweep_dir) / "study.journal"  # not in .llmexp/, which the local launcher removes after each batch


def journal_storage(sweep_dir: Path) -> Any:
    """The sweep directory's optuna JournalStorage: one append-only file under a lock file, which works on
    a shared filesystem (optuna's symlink lock), so jobs on SLURM nodes and the sweeper share it."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = study_journal(sweep_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


def make_pruner(name: str, eval_steps: int, max_steps: int) -> Any:
    """`sweep.pruner`, its resource the training step: rungs start at the first eval after step 0
    (`train.eval_steps`), and go up by a factor of 3 (ASHA's and Hyperband's usual reduction)."""
    import optuna

    if name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=eval_steps, reduction_factor=3)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=eval_steps, reduction_factor=3,
                                              max_resource=max_steps if max_steps > 0 else "auto")
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2)  # from the first eval on: step 0 is never reported
    return optuna.pruners.NopPruner()


def load_study(sweep_dir: Path, pruner: Any = None) -> Any:
    """The sweep directory's study (it must exist), with `pruner` (a trial's own, built from its config)."""
    import optuna

    return optuna.load_study(study_name=STUDY_NAME, storage=journal_storage(sweep_dir), pruner=pruner)
