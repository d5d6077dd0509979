"""Optional sinks for the metric records: wandb (offline files unless an API key is set) and tensorboard."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig

# One definition of what a secret is, shared with every other writer of run files.
from llmexp.rundir.redact import scrub, scrub_overrides, scrub_text

_log = logging.getLogger(__name__)


class Sink(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def make_sinks(cfg: DictConfig, run_dir: Path) -> list[Sink]:
    """The optional sink the `logger` group picks (wandb or tensorboard); jsonl is always on."""
    if cfg.logger.name == "wandb":
        from hydra.core.hydra_config import HydraConfig

        from llmexp.config.schema import to_container

        run_name = HydraConfig.get().job.override_dirname or "default"
        return [WandbSink(run_dir, to_container(cfg), run_name, cfg.logger)]
    if cfg.logger.name == "tensorboard":
        return [TensorBoardSink(run_dir)]
    return []


DEFAULT_INIT_TIMEOUT_S = 10.0
"""The default of `logger.init_timeout_s`, for sink configs made without the schema."""


def run_name_from_overrides(overrides: list[str] | str, max_len: int = 128) -> str:
    """A readable run name from the overrides (`lr=1e-3,batch_size=4`), secrets removed; `default` if none."""
    items = overrides.split(",") if isinstance(overrides, str) else list(overrides)
    items = [o for o in scrub_overrides([o for o in items if o]) if not o.lstrip("+~").startswith("hydra.")]
    name = ",".join(items) or "default"
    return name if len(name) <= max_len else name[:max_len - 3] + "..."


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a train or eval record, under `train/` or `eval/`, and a task's metrics under
    `tasks/<name>/`; NaN/inf kept as floats."""
    event = record.get("event")
    if event == "eval_task":  # tasks/<name>/<metric>: the names sweep.metric takes
        return {f"tasks/{record['task']}/{k}": float(v) for k, v in record["metrics"].items()
                if isinstance(v, int | float) and not isinstance(v, bool)}
    if event not in ("train", "eval"):
        return {}
    out = {}
    for key, value in record.items():
        if key in ("event", "step") or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[f"{event}/{key}"] = float(value)
    return out


def wandb_mode(configured: str) -> str:
    """offline when asked to be, or when there is no API key: a run must never block on a login prompt."""
    if os.environ.get("WANDB_MODE") in ("offline", "disabled"):
        return os.environ["WANDB_MODE"]
    if configured in ("offline", "disabled"):
        return configured
    if configured == "online":
        return "online"
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class WandbSink:
    """Weights & Biases: the resolved config (secrets removed), train/* and eval/* against trainer/step."""

    def __init__(self, run_dir: Path, cfg_container: dict, run_name: str, logger_cfg: Any) -> None:
        if os.environ.get("WANDB_MODE") == "":  # empty means unset to a shell user; wandb would raise on it
            del os.environ["WANDB_MODE"]
        import wandb

        get = logger_cfg.get if hasattr(logger_cfg, "get") else lambda k, d=None: getattr(logger_cfg, k, d)
        self.mode = wandb_mode(str(get("mode", "auto") or "auto"))
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        tags = get("tags", None)
        timeout_s = float(get("init_timeout_s", DEFAULT_INIT_TIMEOUT_S))

        def start(mode: str) -> Any:
            return wandb.init(
                project=get("project", "llmexp"), entity=get("entity", None), name=run_name_from_overrides(run_name),
                dir=str(run_dir), config=scrub(cfg_container), tags=list(tags) if tags else None, mode=mode,
                reinit="create_new",
                settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, init_timeout=timeout_s),
            )

        try:
            self.run = start(self.mode)
        except wandb.errors.Error as err:  # no network, server down, key refused: the run goes on offline
            if self.mode != "online":
                raise
            reason = scrub_text(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
            self.mode = "offline"
            self.run = start(self.mode)
            _log.warning(f"wandb could not start online within logger.init_timeout_s={timeout_s:g} ({reason}); "
                        f"logging offline to {run_dir / 'wandb'} instead. Upload it later with "
                        f"`wandb sync {run_dir / 'wandb'}/offline-run-*`")
        # Steps go backwards after a resume or rollback; wandb's own step must not, so plot against ours.
        self.run.define_metric("trainer/step")
        self.run.define_metric("train/*", step_metric="trainer/step")
        self.run.define_metric("eval/*", step_metric="trainer/step")
        self.run.define_metric("tasks/*", step_metric="trainer/step")

    def log(self, record: dict[str, Any]) -> None:
        if record.get("event") == "sample":  # a table per sampling step: prompt, continuation
            import wandb

            rows = [[int(record["step"]), s["prompt"], s["completion"]] for s in record["samples"]]
            self.run.log({"trainer/step": int(record["step"]),
                          "samples": wandb.Table(columns=["step", "prompt", "completion"], data=rows)})
            return
        data = _numbers(record)
        if data:
            self.run.log({"trainer/step": int(record["step"]), **data})

    def close(self) -> None:
        if self.run is not None:
            import wandb

            self.run.finish()
            self.run = None
            wandb.teardown()  # flushes the run file now rather than at interpreter exit


class TensorBoardSink:
    """TensorBoard event files under `run_dir/tensorboard`: train/* and eval/* scalars by step."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / "tensorboard"
        self.writer: Any = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for tag, value in _numbers(record).items():
            if math.isfinite(value) or tag.endswith(("loss", "grad_norm")):  # a NaN loss is worth seeing
                self.writer.add_scalar(tag, value, global_step=step)
        if record.get("event") == "finding":
            self.writer.add_text("findings", f"**{record.get('severity')}** {record.get('kind')}: "
                                             f"{record.get('message')} — {record.get('advice')}", global_step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
