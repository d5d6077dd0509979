"""Optional sinks for the metric records: wandb (offline files unless an API key is set), tensorboard (with the
HParams view's data), mlflow (`llmexp.monitor.mlflow_sink`)."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from llmexp.config.schema import LoggerConfig
from llmexp.errors import UserError, first_line
from llmexp.monitor.records import Sink, numbers, run_name_from_overrides
from llmexp.rundir.read import load_summary, swept_keys
from llmexp.rundir.redact import scrub, scrub_text  # one definition of a secret, shared by every writer

_log = logging.getLogger(__name__)


def make_sinks(cfg: DictConfig, run_dir: Path) -> list[Sink]:
    """The optional sink the `logger` group picks (wandb, tensorboard or mlflow); jsonl is always on."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if cfg.logger.name not in ("wandb", "tensorboard", "mlflow"):
        return []
    hydra = HydraConfig.get()
    run_name = hydra.job.override_dirname or "default"
    sweep_dir = Path(str(hydra.sweep.dir)) if hydra.mode == RunMode.MULTIRUN else None
    if cfg.logger.name == "wandb":
        return [WandbSink(run_dir, OmegaConf.to_container(cfg, resolve=True), run_name, cfg.logger)]
    if cfg.logger.name == "tensorboard":
        keys = swept_keys(sweep_dir) if sweep_dir is not None else [o.partition("=")[0] for o in hydra.overrides.task]
        return [TensorBoardSink(run_dir, hparams_of(cfg, keys))]
    from llmexp.monitor.mlflow_sink import MlflowSink

    if sweep_dir is not None:  # a job's name: what its sweep varies (`lr=0.001`), as its parent run lists them
        swept = set(swept_keys(sweep_dir))
        run_name = ",".join(o for o in hydra.overrides.task if o.partition("=")[0].lstrip("+~") in swept) or run_name
    fresh = cfg.train.resume == "never"  # a new MLflow run, as metrics.jsonl starts over
    return [MlflowSink(run_dir, OmegaConf.to_container(cfg, resolve=True), cfg.logger, run_name, sweep_dir,
                       new_run=fresh)]


HPARAM_FACTS = {"lr": "lr_chosen", "batch_size": "batch_size", "precision": "precision", "optimizer": "optimizer"}
"""The hyper-parameters every run shows in TensorBoard's HParams view -> the `start` record field holding the
value it ran with (lr=auto resolved, the micro-batch batch_size=auto chose, the precision auto picked)."""
HPARAM_METRICS = ("eval_loss", "eval_ppl", "train_loss", "best_eval_loss", "tokens_per_sec")
"""summary.json's final metrics, shown as `hparam/<name>` columns."""


def hparams_of(cfg: DictConfig, keys: list[str]) -> dict[str, Any]:
    """`keys` (a sweep's swept keys, or a single run's overrides) with the values this run has: a group's
    option name (`optimizer=lion` -> lion), lists as JSON; secrets redacted."""
    out: dict[str, Any] = {}
    for key in (k.lstrip("+~") for k in keys):
        if key.startswith("hydra.") or key in out:
            continue
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, DictConfig) and "name" in value:
            value = value.name
        elif OmegaConf.is_config(value):
            value = json.dumps(OmegaConf.to_container(value, resolve=True))
        out[key] = value if isinstance(value, bool | int | float | str) else json.dumps(value)
    return scrub(out)


def wandb_mode(configured: str) -> str:
    """offline when asked to be, or when there is no API key: a run must never block on a login prompt."""
    if (forced := os.environ.get("WANDB_MODE")) in ("offline", "disabled"):
        return forced
    if configured in ("online", "offline", "disabled"):
        return configured
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class WandbSink(Sink):
    """Weights & Biases: the resolved config (secrets removed), train/*, eval/* and tasks/* against trainer/step."""

    def __init__(self, run_dir: Path, cfg_container: dict, run_name: str, logger_cfg: LoggerConfig) -> None:
        if os.environ.get("WANDB_MODE") == "":  # empty means unset to a shell user; wandb would raise on it
            del os.environ["WANDB_MODE"]
        import wandb

        self.mode = wandb_mode(logger_cfg.mode)
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        tags, timeout_s = logger_cfg.tags, float(logger_cfg.init_timeout_s)

        def start(mode: str) -> Any:
            return wandb.init(
                project=logger_cfg.project, entity=logger_cfg.entity, name=run_name_from_overrides(run_name),
                dir=str(run_dir), config=scrub(cfg_container), tags=list(tags) if tags else None, mode=mode,
                reinit="create_new",
                settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, init_timeout=timeout_s),
            )

        try:
            self.run = start(self.mode)
        except wandb.errors.Error as err:  # no network, server down, key refused: the run goes on offline
            if self.mode != "online":
                raise
            reason = scrub_text(first_line(err, None) or type(err).__name__)
            self.mode = "offline"
            self.run = start(self.mode)
            _log.warning(f"wandb could not start online within logger.init_timeout_s={timeout_s:g} ({reason}); "
                        f"logging offline to {run_dir / 'wandb'} instead. Upload it later with "
                        f"`wandb sync {run_dir / 'wandb'}/offline-run-*`")
        # Steps go backwards after a resume or rollback; wandb's own step must not, so plot against ours.
        self.run.define_metric("trainer/step")
        for group in ("train/*", "eval/*", "tasks/*"):
            self.run.define_metric(group, step_metric="trainer/step")

    def log(self, record: dict[str, Any]) -> None:
        if record.get("event") == "sample":  # a table per sampling step: prompt, continuation
            import wandb

            rows = [[int(record["step"]), s["prompt"], s["completion"]] for s in record["samples"]]
            self.run.log({"trainer/step": int(record["step"]),
                          "samples": wandb.Table(columns=["step", "prompt", "completion"], data=rows)})
            return
        if data := numbers(record):
            self.run.log({"trainer/step": int(record["step"]), **data})

    def close(self) -> None:
        if self.run is not None:
            import wandb

            self.run.finish()
            self.run = None
            wandb.teardown()  # flushes the run file now rather than at interpreter exit


class TensorBoardSink(Sink):
    """TensorBoard event files under `run_dir/tensorboard`: train/* and eval/* scalars by step, findings as text, and
    at the end the HParams view's data (`hparams`): docs/how-to/trackers.md ("TensorBoard", "Comparing runs")."""

    def __init__(self, run_dir: Path, hparams: dict[str, Any] | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = Path(run_dir)
        self.log_dir = self.run_dir / "tensorboard"
        try:
            self.writer: Any = SummaryWriter(log_dir=str(self.log_dir))
        except OSError as err:  # a file where the directory belongs, a directory without write permission
            raise UserError(f"logger=tensorboard: cannot write its event files in {self.log_dir} "
                            f"({err.strerror or err}); remove or rename what is there, or pick another logger"
                            ) from None
        self.hparams = hparams

    def log(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        if record.get("event") == "start" and self.hparams is not None:
            self.hparams.update({k: record[f] for k, f in HPARAM_FACTS.items() if record.get(f) is not None})
        for tag, value in numbers(record).items():
            if math.isfinite(value) or tag.endswith(("loss", "grad_norm")):  # a NaN loss is worth seeing
                self.writer.add_scalar(tag, value, global_step=step)
        if record.get("event") == "finding":
            self.writer.add_text("findings", f"**{record.get('severity')}** {record.get('kind')}: "
                                             f"{record.get('message')} — {record.get('advice')}", global_step=step)

    def close(self) -> None:
        if self.writer is not None:
            if self.hparams is not None:
                self._write_hparams()
            self.writer.close()
            self.writer = None

    def _write_hparams(self) -> None:
        """One HParams session per run; a resumed run's replaces the one its earlier attempt wrote."""
        summary = load_summary(self.run_dir) or {}
        metrics = {f"hparam/{k}": float(v) for k in HPARAM_METRICS
                   if isinstance(v := summary.get(k), int | float) and math.isfinite(v)}
        if not metrics:  # no summary (a crash): nothing to compare
            return
        shutil.rmtree(self.log_dir / "hparams", ignore_errors=True)
        hparams = {**self.hparams, "status": str(summary.get("status"))}
        self.writer.add_hparams(hparams, metrics, run_name="hparams", global_step=int(summary.get("step") or 0))
