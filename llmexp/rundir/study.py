"""A search's optuna study as every layer meets it: where it is stored, and its pruner. The sweeper
(`llmexp.sweep.search`), each trial's trainer (`llmexp.train.pruning`, on whatever node) and the report open the
same file (`study_journal`) and build the pruner from the same config keys, so a trial needs nothing from the
sweeper but its config. optuna is imported in the functions only: `--help` never pays for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmexp.errors import UserError, first_line
from llmexp.rundir.readers import read_bytes, reader

STUDY_NAME = "llmexp"
"""The optuna study's name inside `study_journal`."""

SEARCHES = ("random", "tpe")
"""`sweep.name`s that are optuna searches (`grid` is Hydra's grid)."""


def study_journal(sweep_dir: Path) -> Path:
    """Where an optuna search keeps its study (`sweep=random|tpe`): an optuna JournalStorage file, study
    name `STUDY_NAME`, safe on a shared filesystem. Trial number N is the sweep's job N (`SWEEP_DIR/N`)."""
    return Path(sweep_dir) / "study.journal"  # not in .llmexp/, which the local launcher removes after each batch


def journal_storage(sweep_dir: Path) -> Any:
    """The sweep directory's optuna JournalStorage, which SLURM nodes and the sweeper share (optuna's symlink lock
    works on a shared filesystem); a journal optuna cannot replay is a UserError (`damaged`), not a traceback."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = study_journal(sweep_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return JournalStorage(JournalFileBackend(str(path)))  # replays the whole journal
    except Exception as err:  # JSONDecodeError, KeyError, ValueError ...: whatever the bytes made optuna do
        raise damaged(path, f"optuna cannot replay it: {type(err).__name__}: {first_line(err)}") from None


def check_journal(sweep_dir: Path) -> None:
    """Before a search continues in `sweep_dir`: its `study.journal`, if any, is a whole optuna journal that replays.
    optuna itself skips a last line cut short and appends after it, which damages the file for good; a line of
    garbage raises deep inside optuna."""
    path = study_journal(sweep_dir)
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_file():
        raise damaged(path, "it is not a file")
    data = read_journal(path)
    if data is None:
        raise damaged(path, "it cannot be read")
    if problem := _journal_problem(data):
        raise damaged(path, problem)
    if data:
        load_study(Path(sweep_dir))  # replays it: a UserError when optuna cannot


@reader
def read_journal(path: Path) -> bytes:
    """study.journal's bytes, read under optuna's own lock (a trial left running by an earlier sweeper cannot be
    caught half-way through a write)."""
    from optuna.storages.journal import JournalFileSymlinkLock

    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        return read_bytes(path, None)
    finally:
        lock.release()


def _journal_problem(data: bytes) -> str | None:
    """Why `data` is not an optuna journal, line by line, or None."""
    from optuna.storages.journal._storage import JournalOperation  # the op codes optuna writes

    lines = data.split(b"\n")
    if lines.pop():  # a file that ends with a newline leaves b"" here
        return f"its last line is cut short (line {len(lines) + 1}: the file was truncated)"
    codes = {op.value for op in JournalOperation}
    for number, line in enumerate(lines, start=1):
        try:
            entry = json.loads(line)
        except ValueError:
            return f"line {number} is not JSON"
        if not isinstance(entry, dict) or entry.get("op_code") not in codes:
            return f"line {number} is not an optuna journal entry"
    return None


def damaged(path: Path, problem: str) -> UserError:
    return UserError(f"{path}: this search's study.journal is damaged ({problem}), so the search cannot continue "
                     f"from it. Start it afresh in a new directory, hydra.sweep.dir=<new dir> (the trials' run "
                     f"directories stay readable: python -m llmexp.report {path.parent}), or, if you keep a copy "
                     f"of the journal, put it back at {path}")


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

    try:  # (journal_storage raises its own UserError, never a KeyError)
        return optuna.load_study(study_name=STUDY_NAME, storage=journal_storage(sweep_dir), pruner=pruner)
    except KeyError as err:  # a journal with studies, none of them llmexp's
        raise damaged(study_journal(sweep_dir), f"it holds no study named {STUDY_NAME!r}: {first_line(err)}") from None
