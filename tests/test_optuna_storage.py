"""optuna's own storage conformance suite (`optuna.testing.pytest_storages.StorageTestCase`, shipped in the
optuna wheel, which optuna runs against each of its storages) against the storage llmexp's searches use:
`llmexp.rundir.study.journal_storage(sweep_dir)`, a JournalStorage on `SWEEP_DIR/study.journal`.

Twice: as one process sees it (one storage object), and as a search uses it, where the sweeper and every
trial's trainer (`llmexp.train.pruning`, on a SLURM node or in a local job process) each open the same
file: there every call goes through a storage opened afresh on the file, so the suite passes only if
everything a call leaves behind is in the journal, not in the object that made it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from optuna.storages import BaseStorage, JournalStorage
from optuna.testing.pytest_storages import StorageTestCase

from llmexp.rundir.study import journal_storage, study_journal


class OpenedPerCall:
    """A storage whose every call opens the sweep directory's journal anew, as another process would.

    The wrapped storages are JournalStorages that replay the file on open; a new one per call keeps no
    state between calls. It is a BaseStorage by duck typing only (the suite calls methods, never isinstance):
    subclassing would bring BaseStorage's default methods, built on the abstract ones, and hide which
    of the journal's own implementations ran."""

    def __init__(self, sweep_dir: Path) -> None:
        self.sweep_dir = sweep_dir
        self.opened = 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # pickle's probes (__setstate__...), before __init__ ran on unpickling
            raise AttributeError(name)
        storage = journal_storage(self.sweep_dir)
        self.opened += 1
        return getattr(storage, name)


@pytest.fixture(params=["one_process", "a_process_per_call"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BaseStorage]:
    """The fixture optuna's suite asks for (its own raises NotImplementedError): a fresh sweep directory's."""
    if request.param == "one_process":
        store = journal_storage(tmp_path / "sweep")
        assert isinstance(store, JournalStorage)
        yield store
    else:
        per_call = OpenedPerCall(tmp_path / "sweep")
        yield per_call  # type: ignore[misc]
        assert per_call.opened > 0  # the suite's calls went through fresh storages
    assert study_journal(tmp_path / "sweep").is_file()  # every test wrote to the file the trials read


class TestJournalStorage(StorageTestCase):
    """Every test of optuna's suite, unchanged, on the storage above."""
