"""The one way llmexp writes a file in place: atomically, so that readers see the old file or the new one,
never half of one. No torch here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


@contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a file to be written so that readers see the old one or the new one, never half of one:
    every llmexp file written in place (summary.json, report.md, plots, metrics.jsonl on resume, a
    scrubbed `.hydra/` file, a job's pickle) goes through here.

    A unique temp file beside the target (concurrent writers never share one) is fsync'd, then
    renamed over it; on any failure the temp file is removed and the old file stays.
    """
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_file(path) as f:
        f.write(text)


def write_json_atomic(path: Path, obj: object) -> None:
    """JSON through write_text_atomic."""
    import json

    write_text_atomic(path, json.dumps(obj, indent=2, default=str))
