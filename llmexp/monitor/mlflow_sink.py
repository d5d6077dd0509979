"""`logger=mlflow`: each run is an MLflow run, a sweep's jobs nested runs of one parent run.

What a run sends, where the store is and what a lost server does: docs/how-to/trackers.md. Why it is built so:
the run's id is kept in the run directory (`mlflow_run.json`) so that a resumed or requeued run continues the
same MLflow run, sending only the steps MLflow lacks (a `kill -9` leaves some unsent); metrics go out from a
thread of their own, so a slow or lost server never stalls a step. mlflow is imported only when this sink is used.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmexp.errors import first_line
from llmexp.monitor.records import Sink, cut, numbers, run_name_from_overrides
from llmexp.rundir.read import load_summary
from llmexp.rundir.redact import scrub, scrub_text
from llmexp.rundir.tracking import (
    LOCAL_ARTIFACTS,
    local_db_dir,
    local_tracking_uri,
    read_mlflow_run,
    write_mlflow_run,
)

_log = logging.getLogger(__name__)

FLUSH_S = 2.0
"""Seconds between two sends of the metrics logged meanwhile (an eval record is sent at once)."""
RETRY_S = 30.0
"""After a failed send, seconds before the next try (the records wait, up to `MAX_PENDING`)."""
MAX_PENDING = 200_000
"""Metrics kept for a server that is down; older ones are dropped (metrics.jsonl has them all)."""
MAX_PARAM_LEN = 6000
"""MLflow's limit on a param value; a longer value (a long prompt list) is cut, with `...`."""
MAX_TAG_LEN = 5000
BATCH_METRICS, BATCH_PARAMS = 1000, 100
"""MLflow's limits per `log_batch` call."""

STATUS_OF = {"completed": "FINISHED", "early_stopped": "FINISHED", "pruned": "FINISHED", "preempted": "KILLED",
             "diverged": "FAILED", "failed": "FAILED"}
"""llmexp's run status -> MLflow's run status (a preempted run is KILLED until its resume sets it RUNNING)."""
ARTIFACTS = ("summary.json", "report.md", "curves.png")
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
"""MLflow's HTTP settings for the run's process, unless the environment sets them."""


@dataclass
class Store:
    """An MLflow store that answered, and the experiment in it."""

    client: Any
    uri: str
    experiment_id: str


def client_for(uri: str) -> Any:
    """An MlflowClient for `uri`, with this module's HTTP settings unless the environment has its own."""
    from mlflow import MlflowClient

    _use_env_defaults()
    return MlflowClient(tracking_uri=uri)


def _use_env_defaults() -> None:
    """mlflow's settings for the run's process (HTTP limits, logging), unless the environment has its own."""
    for name, default in HTTP_DEFAULTS.items():  # mlflow's own (7 retries, 120 s) would stall a closing run
        os.environ.setdefault(name, default)
    # mlflow's loggers, left unconfigured by mlflow, go through the root logger as every library's do: on the
    # console as llmexp shows third-party lines, and into llmexp.log (mlflow's own handler bypassed both)
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")


@contextlib.contextmanager
def _http_limits(timeout_s: float, retries: int) -> Iterator[None]:
    """MLflow's HTTP timeout and retries for the calls inside (read by mlflow at each request); after them, the
    process's own (`HTTP_DEFAULTS`, set first so that the sends after `connect` keep them)."""
    _use_env_defaults()
    names = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, math.ceil(timeout_s))),
             "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(retries)}
    saved = {k: os.environ[k] for k in names}  # both are HTTP_DEFAULTS' keys: set by now
    os.environ.update(names)
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """mlflow's store emits SQLAlchemy deprecation warnings on stderr: not the user's business."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _open(uri: str, experiment: str, timeout_s: float) -> Store:
    """The store at `uri` and the id of `experiment` in it (created when missing); raises when unreachable."""
    _use_env_defaults()  # before mlflow is first imported: it reads MLFLOW_CONFIGURE_LOGGING then
    from mlflow.exceptions import MlflowException

    db_dir = local_db_dir(uri)
    lock: Any = contextlib.nullcontext()
    if db_dir is not None:  # parallel jobs may create one SQLite store at once: its schema is made once
        from filelock import FileLock

        db_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(db_dir / ".mlflow.db.lock"))
    with lock, _quiet(), _http_limits(timeout_s, retries=0):
        client = client_for(uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            location = str(db_dir / LOCAL_ARTIFACTS) if db_dir is not None else None
            try:
                return Store(client, uri, client.create_experiment(experiment, artifact_location=location))
            except MlflowException:  # another job created it first
                found = client.get_experiment_by_name(experiment)
                if found is None:
                    raise
        if found.lifecycle_stage == "deleted":
            client.restore_experiment(found.experiment_id)
            _log.warning(f"mlflow: the experiment {experiment!r} had been deleted; restored it to log to it")
        return Store(client, uri, found.experiment_id)


def connect(uri: str | None, experiment: str, local_dir: Path, timeout_s: float) -> Store:
    """The configured store, or `local_dir`'s SQLite store when it is None or cannot be reached (one warning)."""
    local = local_tracking_uri(local_dir)
    if uri is None or uri == local:
        return _open(local, experiment, timeout_s)
    try:
        return _open(uri, experiment, timeout_s)
    except Exception as err:  # refused, unreachable, credentials rejected: the run logs locally instead
        reason = scrub_text(first_line(err, None) or type(err).__name__)[:300]
        _log.warning(f"mlflow could not reach {uri} within logger.init_timeout_s={timeout_s:g} ({reason}); logging "
                     f"to {local} instead. See it with `mlflow ui --backend-store-uri {local}`")
        return _open(local, experiment, timeout_s)


def continue_or_create(store: Store, folder: Path, run_name: str, tags: dict[str, str],
                       new_run: bool = False) -> tuple[Any, bool]:
    """The MLflow run that `folder` records (`mlflow_run.json`), set RUNNING again, if this store still has it
    (not deleted) in the store's experiment; else a new run with `tags`, recorded in `folder` (another
    `logger.experiment`: a new run there, as asked). Returns the run and whether it was continued. A run's sink and
    a sweep's parent run both use it."""
    known = None if new_run else read_mlflow_run(folder)
    if known is not None and known["tracking_uri"] == store.uri:
        run = None
        with contextlib.suppress(Exception), _quiet():  # gone from the store (deleted, another database)
            run = store.client.get_run(known["run_id"])
        if run is not None and run.info.lifecycle_stage != "deleted" and run.info.experiment_id == store.experiment_id:
            with _quiet():
                store.client.update_run(run.info.run_id, status="RUNNING")
            return run, True
    with _quiet():
        run = store.client.create_run(store.experiment_id, run_name=run_name, tags=tags)
    folder.mkdir(parents=True, exist_ok=True)
    write_mlflow_run(folder, store.uri, store.experiment_id, run.info.run_id)
    return run, False


def flat_params(container: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys, lists and empty dicts as JSON, each value at most
    `MAX_PARAM_LEN` characters."""
    out: dict[str, str] = {}
    for key, value in container.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, name + "."))
            continue
        out[name] = cut(value if isinstance(value, str) else json.dumps(value, default=str), MAX_PARAM_LEN)
    return out


def finding_tags(findings: list[Mapping[str, Any]]) -> dict[str, str]:
    """`finding.<kind>`: severity, step, message and advice (and, from summary.json, open or resolved)."""
    tags = {}
    for f in findings:
        status = f" [{f['status']}]" if f.get("status") else ""
        tags[f"finding.{f.get('kind')}"] = cut(f"{f.get('severity')} at step {f.get('step')}: {f.get('message')} -> "
                                               f"{f.get('advice')}{status}", MAX_TAG_LEN)
    return tags


def _upload(client: Any, run_id: str, folder: Path, names: tuple[str, ...]) -> None:
    """The files of `names` that `folder` holds, as artifacts of the run."""
    for name in names:
        if (folder / name).is_file():
            client.log_artifact(run_id, str(folder / name))


class _Sender(threading.Thread):
    """Sends the queued metrics and tags of one run; after a failure it warns once and waits `RETRY_S`."""

    def __init__(self, client: Any, run_id: str) -> None:
        super().__init__(name="llmexp-mlflow", daemon=True)
        self.client, self.run_id = client, run_id
        self.lock = threading.Lock()
        self.metrics: list[Any] = []
        self.tags: dict[str, str] = {}
        self.wake, self.stopping = threading.Event(), threading.Event()
        self.failing: str | None = None
        """Why the last send failed; None while sends succeed."""
        self.dropped = 0

    def add(self, metrics: list[Any], tags: Mapping[str, str] | None = None, now: bool = False) -> None:
        with self.lock:
            self.metrics.extend(metrics)
            if len(self.metrics) > MAX_PENDING:
                self.dropped += len(self.metrics) - MAX_PENDING
                del self.metrics[:len(self.metrics) - MAX_PENDING]
            self.tags.update(tags or {})
        if now:
            self.wake.set()

    def run(self) -> None:
        while not self.stopping.is_set():
            self.wake.wait(FLUSH_S if self.failing is None else RETRY_S)
            self.wake.clear()
            if not self.stopping.is_set():
                self.send()
        self.send()  # what the last records left

    def send(self) -> None:
        """Everything queued, in `log_batch` calls of MLflow's sizes; what a failure leaves unsent waits."""
        from mlflow.entities import RunTag

        with self.lock:
            metrics, tags = self.metrics, list(self.tags.items())
            self.metrics, self.tags = [], {}
        sent_m = sent_t = 0
        try:
            with _quiet():
                while sent_m < len(metrics) or sent_t < len(tags):
                    chunk = metrics[sent_m:sent_m + BATCH_METRICS]
                    tag_chunk = [RunTag(k, v) for k, v in tags[sent_t:sent_t + BATCH_PARAMS]]
                    self.client.log_batch(self.run_id, metrics=chunk, tags=tag_chunk)
                    sent_m, sent_t = sent_m + len(chunk), sent_t + len(tag_chunk)
        except Exception as err:  # the server went away: keep what was not sent, say so once
            with self.lock:
                self.metrics[:0] = metrics[sent_m:]
                self.tags = {**dict(tags[sent_t:]), **self.tags}
            if self.failing is None:
                self.failing = scrub_text(first_line(err, None) or repr(err))[:300]
                _log.warning(f"mlflow: sending metrics failed ({self.failing}); the run goes on (metrics.jsonl has "
                             f"every record) and retries every {RETRY_S:g} s")
            return
        self.failing = None

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        self.join()


class MlflowSink(Sink):
    """One llmexp run as one MLflow run: params, metrics by step, findings as tags, artifacts at the end."""

    def __init__(self, run_dir: Path, cfg_container: dict, logger_cfg: Any, run_name: str,
                 sweep_dir: Path | None = None, new_run: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.log_model = bool(logger_cfg.log_model)
        self.sender: _Sender | None = None
        self._have: dict[str, set[int]] = {}
        """Steps each metric already had in MLflow when this process started (a resumed run's)."""
        self.continued = False
        try:
            self._start(cfg_container, logger_cfg, run_name, sweep_dir, new_run)
        except Exception as err:  # even the local store failed: the run goes on without MLflow
            reason = scrub_text(first_line(err, None) or repr(err))[:300]
            _log.warning(f"mlflow: could not start a run ({type(err).__name__}: {reason}); this run logs to "
                         "metrics.jsonl only")
            self.sender = None

    def _start(self, cfg_container: dict, lg: Any, run_name: str, sweep_dir: Path | None, new_run: bool) -> None:
        self.store = connect(lg.tracking_uri, str(lg.experiment), sweep_dir or self.run_dir, float(lg.init_timeout_s))
        tags = {"llmexp.run_dir": str(self.run_dir.absolute())}
        parent = read_mlflow_run(sweep_dir) if sweep_dir is not None else None
        if parent is not None and parent["tracking_uri"] == self.store.uri:
            tags["mlflow.parentRunId"] = parent["run_id"]
        run, self.continued = continue_or_create(self.store, self.run_dir, run_name_from_overrides(run_name), tags,
                                                 new_run=new_run)
        self.run_id = run.info.run_id
        self._log_params(self.store.client, flat_params(scrub(cfg_container)), dict(run.data.params))
        self.sender = _Sender(self.store.client, self.run_id)
        self.sender.start()

    def _log_params(self, client: Any, params: dict[str, str], existing: dict[str, str]) -> None:
        """The params the run lacks (MLflow refuses to change one: a resume with another value keeps the first,
        and a tag names the keys that differ)."""
        from mlflow.entities import Param, RunTag

        new = [Param(k, v) for k, v in params.items() if k not in existing]
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
        tags = [RunTag("llmexp.params_changed_on_resume", cut(", ".join(changed), MAX_TAG_LEN))] if changed else []
        with _quiet():
            for i in range(0, max(len(new), len(tags)), BATCH_PARAMS):  # the tag goes with the first batch
                client.log_batch(self.run_id, params=new[i:i + BATCH_PARAMS], tags=tags if i == 0 else [])

    # ------------------------------------------------------------------ the Sink protocol
    def reset(self, records: list[dict[str, Any]]) -> None:
        """The run (re)starts from `records` (a checkpoint's history, or none): note what a continued MLflow run
        already holds, so no step is sent twice, and send what it lacks of that history (all of it to a new
        MLflow run, e.g. a run resumed with logger=mlflow that started without it)."""
        if self.sender is None:
            return
        if self.continued:
            client = self.store.client
            try:
                with _quiet():
                    keys = client.get_run(self.run_id).data.metrics
                    self._have = {key: {m.step for m in client.get_metric_history(self.run_id, key)} for key in keys}
            except Exception as err:
                _log.warning(f"mlflow: could not read the run's metric history ({type(err).__name__}); steps sent "
                             "before the resume may appear twice")
        for record in records:
            self.log(record)

    def log(self, record: dict[str, Any]) -> None:
        if self.sender is None:
            return
        from mlflow.entities import Metric

        event, step = record.get("event"), int(record.get("step", 0))
        if event == "finding":
            self.sender.add([], finding_tags([record]))
            return
        if event == "start":
            facts = {k: record.get(k) for k in ("lr_chosen", "lr_source", "num_params", "precision",
                                                "global_batch_size", "batch_size")}
            self.sender.add([], {f"llmexp.{k}": str(v) for k, v in facts.items() if v is not None})
            return
        now_ms = int(time.time() * 1000)
        metrics = [Metric(key, value, now_ms, step) for key, value in numbers(record).items()
                   if step not in self._have.get(key, ())]
        if metrics:
            self.sender.add(metrics, now=event == "eval")

    def close(self) -> None:
        if self.sender is None:
            return
        sender, self.sender = self.sender, None
        summary = load_summary(self.run_dir) or {}
        status = str(summary.get("status") or "failed")
        sender.add([], {"llmexp.status": status, **finding_tags(summary.get("findings") or [])})
        sender.stop()
        if sender.failing is not None:
            _log.warning(f"mlflow: the run's last records, artifacts and status were not sent ({sender.failing}); "
                         f"metrics.jsonl and {self.run_dir} have them")
            return
        if sender.dropped:
            _log.warning(f"mlflow: {sender.dropped} metrics were dropped while the server was unreachable")
        client = self.store.client
        try:
            with _quiet():
                _upload(client, self.run_id, self.run_dir, ARTIFACTS)
                if self.log_model and (self.run_dir / "model").is_dir():
                    client.log_artifacts(self.run_id, str(self.run_dir / "model"), artifact_path="model")
                client.set_terminated(self.run_id, status=STATUS_OF.get(status, "FAILED"))
        except Exception as err:  # a failed upload must not fail a finished run
            _log.warning(f"mlflow: uploading the artifacts failed ({type(err).__name__}: "
                         f"{scrub_text(str(err))[:300]})")


SWEEP_ARTIFACTS = ("sweep_summary.json", "sweep_report.md", "sweep_curves.png", "sweep_search.png")


def log_sweep_report(sweep_dir: Path) -> None:
    """Upload a sweep's report to its parent run, when the sweep directory records one (`logger=mlflow`)."""
    known = read_mlflow_run(sweep_dir)
    if known is None:
        return
    with _quiet():
        _upload(client_for(known["tracking_uri"]), known["run_id"], Path(sweep_dir), SWEEP_ARTIFACTS)
