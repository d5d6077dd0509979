"""A sweep's parent MLflow run (`logger=mlflow`), its id kept in the sweep directory where each job's run finds it
and nests under it; a rerun or a search's next batch continues it. MLflow trouble never stops a sweep: an
unreachable server gives the local store, anything else a warning and unnested jobs. See docs/how-to/trackers.md.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from llmexp.rundir.redact import scrub_overrides, scrub_text
from llmexp.rundir.tracking import read_mlflow_run

log = logging.getLogger(__name__)


def open_parent(config: Any, sweep_dir: Path) -> None:
    """The parent run of the sweep in `sweep_dir`: continued if the directory records one, else created; for
    llmexp's config (another Hydra app's has no `logger` node) with `logger=mlflow` only."""
    if OmegaConf.select(config, "logger.name", default=None) != "mlflow" or "train" not in config:
        return
    try:
        from llmexp.monitor.mlflow_sink import connect, continue_or_create

        lg = config.logger
        store = connect(lg.tracking_uri, str(lg.experiment), sweep_dir, float(lg.init_timeout_s))
        overrides = " ".join(scrub_overrides([str(o) for o in config.hydra.overrides.task]))
        tags = {"llmexp.sweep_dir": str(sweep_dir), "llmexp.overrides": overrides[:5000]}
        run, continued = continue_or_create(store, sweep_dir, sweep_dir.name, tags)
        if not continued:
            log.info(f"MLflow parent run {run.info.run_id} in {store.uri}")
    except Exception as err:  # the sweep goes on; its jobs' runs are then not nested
        log.warning(f"mlflow: no parent run for the sweep ({type(err).__name__}: {scrub_text(str(err))[:300]}); "
                    "its jobs log runs that are not nested")


def close_parent(sweep_dir: Path, ok: bool) -> None:
    """End the sweep's parent run, if `open_parent` made one: FINISHED when every job finished, else FAILED."""
    known = read_mlflow_run(sweep_dir)
    if known is None:
        return
    try:
        from llmexp.monitor.mlflow_sink import client_for

        client_for(known["tracking_uri"]).set_terminated(known["run_id"], status="FINISHED" if ok else "FAILED")
    except Exception as err:
        log.warning(f"mlflow: could not end the sweep's parent run ({type(err).__name__}: "
                    f"{scrub_text(str(err))[:300]})")
