"""Where a run's or a sweep's MLflow run lives (`mlflow_run.json` in its directory), so that a resumed or requeued
run continues the same MLflow run and a sweep's jobs find their parent. Without `logger.tracking_uri`, a SQLite
store beside it (`mlflow.db`, `mlartifacts/`), so MLflow needs no server. No mlflow import here.
See docs/how-to/trackers.md.
"""

from __future__ import annotations

from pathlib import Path

from llmexp.rundir.files import write_json_atomic
from llmexp.rundir.readers import load_json, reader

MLFLOW_RUN_FILE = "mlflow_run.json"
LOCAL_DB = "mlflow.db"
LOCAL_ARTIFACTS = "mlartifacts"


def local_tracking_uri(directory: Path) -> str:
    """The SQLite store inside a run or sweep directory (absolute, so any working directory reads it)."""
    return f"sqlite:///{Path(directory).absolute() / LOCAL_DB}"


def local_db_dir(tracking_uri: str) -> Path | None:
    """The directory of a local SQLite store's file (where its artifacts go too); None for a server."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return Path(tracking_uri.removeprefix("sqlite:///")).absolute().parent


def read_mlflow_run(directory: Path) -> dict[str, str] | None:
    """The MLflow run recorded in `directory` ({tracking_uri, experiment_id, run_id}), or None."""
    data = read_run_file(Path(directory) / MLFLOW_RUN_FILE)
    if not data or not all(data.get(k) for k in ("tracking_uri", "run_id")):
        return None
    return {k: str(data.get(k) or "") for k in ("tracking_uri", "experiment_id", "run_id")}


@reader
def read_run_file(path: Path) -> dict | None:
    return load_json(path, read_run_file)


def write_mlflow_run(directory: Path, tracking_uri: str, experiment_id: str, run_id: str) -> None:
    write_json_atomic(Path(directory) / MLFLOW_RUN_FILE,
                      {"tracking_uri": tracking_uri, "experiment_id": experiment_id, "run_id": run_id})
