"""Throughput, MFU and memory, and the sinks every metric record goes to.

`metrics.jsonl` is always written (one JSON object per line, flushed, so a killed run keeps
every line it logged); the console gets a progress bar and one dense line per logging step;
wandb and tensorboard are optional sinks (`llmexp.metrics`). Only rank 0 logs.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from omegaconf import DictConfig

# One definition of what a secret is, shared with every other writer of run files.
from llmexp.paths import atomic_file
from llmexp.redact import REDACTED, is_secret_key, scrub, scrub_overrides, scrub_text

CONSOLE_LOGGER = "llmexp.console"
"""The logger that copies every console line into the job log (`llmexp.log`), never to the console itself."""
ETA_AFTER_STEPS = 3
"""Steps timed (after the first, which warms up) before the console prints an ETA."""


class _OwnOrWarning(logging.Filter):
    """Console handlers pass llmexp's own records and anything of WARNING or above."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.split(".")[0] == "llmexp"


def quiet_console() -> None:
    """Keep third-party INFO lines (matplotlib's font cache, ...) out of the console; Hydra's job log
    (`llmexp.log`, a file handler on the root logger) still gets them."""
    for handler in logging.getLogger().handlers:
        console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
        if console and not any(isinstance(f, _OwnOrWarning) for f in handler.filters):
            handler.addFilter(_OwnOrWarning())


def job_log(run_dir: Path) -> tuple[logging.Logger, logging.Handler | None]:
    """(the logger that writes console lines to the job log, the handler this call opened or None).

    The job log is Hydra's: the root logger's file handlers inside the run directory (`hydra.job_logging`,
    by default `RUN_DIR/llmexp.log`). Without one (a run started in-process, or job logging turned off) llmexp
    opens `RUN_DIR/llmexp.log` itself, with the same secret filter.
    """
    from llmexp.redact import install_log_filter

    logger = logging.getLogger(CONSOLE_LOGGER)
    logger.propagate = False  # never twice on the console
    logger.setLevel(logging.INFO)
    root = Path(run_dir).resolve()
    files: list[logging.Handler] = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)
                                    and Path(h.baseFilename).resolve().is_relative_to(root)]
    own = None
    if not files:
        own = logging.FileHandler(run_dir / "llmexp.log", encoding="utf-8")
        own.setFormatter(logging.Formatter("[%(asctime)s] %(message)s"))
        files = [own]
    logger.handlers = files
    install_log_filter(logger)
    return logger, own


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


def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weights plus the attention scores and values.

    Attention adds 2 (QK^T and AV) x 2 (mul+add) x 3 (fwd+bwd) x layers x seq x hidden = 12 L T d
    (the PaLM paper's accounting, no causal discount).
    """
    return 6.0 * num_params + 12.0 * num_layers * seq_len * hidden_size


def measure_peak_tflops(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """A matmul ceiling for MFU, measured here: large square matmuls in the training dtype."""
    n = 8192 if device.type == "cuda" else 1024  # a GPU needs ~1 TFLOP per matmul to hide launch overhead
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the warm-up (and cuBLAS set-up) stays out of the window
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2.0 * n**3 * count / (time.perf_counter() - start) / 1e12


def measure_ceiling(device: torch.device, dtype: torch.dtype, windows: int = 3,
                    seconds: float = 0.1) -> tuple[float, bool]:
    """(the best of `windows` matmul ceilings, whether this process had its cores to itself).

    On CPU, cores shared with other processes show as CPU time below threads x wall time while the
    matmuls run (~0.97 alone here, ~0.5-0.6 beside one or two busy processes). The load average
    cannot tell: it lags by a minute. A ceiling measured on shared cores is too low, and every MFU
    divided by it too high, so it must not be kept.
    """
    wall, cpu = time.perf_counter(), time.process_time()
    best = max(measure_peak_tflops(device, dtype, seconds) for _ in range(windows))
    if device.type != "cpu":
        return best, True
    share = (time.process_time() - cpu) / (torch.get_num_threads() * (time.perf_counter() - wall))
    return best, share >= 0.85


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory: max allocated on CUDA, peak RSS of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def reset_peak_rss() -> None:
    """Make the peak RSS this process's current RSS (Linux >= 4.0: `/proc/self/clear_refs`), so that the next
    `peak_rss_mb` is the peak of what ran since: an earlier, higher one (imports, memory the allocator has since
    returned) would otherwise count."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux: peak_rss_mb is then the whole process's peak (an overestimate at worst)


def peak_rss_mb() -> float:
    """The peak RSS since `reset_peak_rss` (Linux: VmHWM), else the whole process's."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def rss_mb() -> float:
    """This process's resident memory now."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def safe_exp(x: float) -> float:
    """exp(x) as a JSON-safe float (inf instead of OverflowError)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _json_value(value: Any) -> Any:
    """JSON cannot hold NaN/inf; write them as strings so a NaN loss stays visible."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    """Fans each record out to metrics.jsonl, the console and the optional sinks (rank 0 only)."""

    def __init__(self, run_dir: Path, max_steps: int, enabled: bool, sinks: list[Sink] | None = None,
                 start_step: int = 0) -> None:
        from llmexp.redact import secret_env_values

        self.enabled = enabled
        self.sinks = sinks or []
        self._secrets = secret_env_values()  # no record (nor the history a checkpoint keeps) may hold one
        self.history: list[dict[str, Any]] = []
        self._file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8") if enabled else None  # noqa: SIM115
        self._bar = None
        self.max_steps = max_steps
        self._step_times: list[tuple[float, int]] = []  # (time, steps done) at each advance, for the ETA
        self._steps_done = start_step
        self._eta_said = False
        self._job_log: logging.Logger | None = None
        self._own_handler: logging.Handler | None = None
        if enabled:
            from tqdm.auto import tqdm

            self._job_log, self._own_handler = job_log(run_dir)
            self._bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stderr, disable=None if os.environ.get("LLMEXP_NO_BAR") != "1" else True)

    def log(self, record: dict[str, Any]) -> None:
        """Append a record (it must carry `event` and `step`)."""
        from llmexp.redact import scrub

        record = scrub(record, self._secrets)
        self.history.append(record)
        if not self.enabled:
            return
        assert self._file is not None
        self._file.write(json.dumps({k: _json_value(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        for sink in self.sinks:
            sink.log(record)
        line = format_line(record)
        if line:
            eta = self.eta_s() if record["event"] == "train" else None
            self.write(line + (f" | eta {format_duration(eta)}" if eta is not None else ""))

    def reset_history(self, records: list[dict[str, Any]]) -> None:
        """On resume: metrics.jsonl becomes exactly the checkpoint's history (later lines were lost work)."""
        self.history = list(records)
        if not self.enabled:
            return
        assert self._file is not None
        self._file.close()
        path = Path(self._file.name)
        with atomic_file(path) as f:
            f.writelines(json.dumps({k: _json_value(v) for k, v in r.items()}) + "\n" for r in records)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._steps_done = max((int(r.get("step", 0)) for r in records), default=0)
        self._step_times = []
        if self._bar is not None and records:
            self._bar.n = self._steps_done
            self._bar.refresh()

    def write(self, text: str) -> None:
        """Print above the progress bar, and copy the line to the job log (`llmexp.log`)."""
        if not self.enabled:
            return
        if self._bar is not None and not self._bar.disable:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)
        if self._job_log is not None:
            self._job_log.info(text)

    def advance(self, steps: int = 1) -> None:
        """One more optimizer step done; after a few timed steps the console gets one ETA line."""
        if self._bar is not None:
            self._bar.update(steps)
        self._steps_done += steps
        self._step_times.append((time.perf_counter(), self._steps_done))
        if not self._eta_said and (eta := self.eta_s()) is not None:
            self._eta_said = True
            first_t, first_n = self._step_times[0]
            per_step = (self._step_times[-1][0] - first_t) / (self._steps_done - first_n)
            self.write(f"eta {format_duration(eta)} for the {self.max_steps - self._steps_done} remaining steps "
                       f"({per_step:.3g} s/step so far, evals and checkpoints included)")

    def eta_s(self) -> float | None:
        """Seconds left at the pace since the first step (the first one warms up); None until
        `ETA_AFTER_STEPS` steps are timed."""
        if len(self._step_times) <= ETA_AFTER_STEPS:
            return None
        first_t, first_n = self._step_times[0]
        last_t, last_n = self._step_times[-1]
        return (last_t - first_t) / (last_n - first_n) * max(0, self.max_steps - last_n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        for sink in self.sinks:
            sink.close()
        if self._file is not None:
            self._file.close()
        if self._own_handler is not None and self._job_log is not None:
            self._job_log.removeHandler(self._own_handler)
            self._own_handler.close()
            self._own_handler = None


def format_duration(seconds: float) -> str:
    """1h02m, 4m10s, 12s."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _count(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else "?"


def format_header(r: dict[str, Any]) -> str:
    """The console's first lines, from the `start` record: where the run writes, what it trains on, how."""
    params = r.get("num_params", 0) / 1e6
    model = (f"{r.get('model')} from {r['model_path']} (fine-tuning)" if r.get("model_path")
             else f"{r.get('model')} (from scratch)")
    cache = "cache hit" if r.get("data_cache_hit") else "tokenised now, cached"
    if r.get("data_streaming"):
        cache = "streamed: tokenised as it trains, not cached"
    eval_tokens = f", {_count(r.get('data_eval_tokens'))} eval tokens" if "data_eval_tokens" in r else ""
    accum, world, micro = r.get("gradient_accumulation_steps"), r.get("world_size"), r.get("batch_size")
    batch = r.get("global_batch_size")
    tokens = batch * r["max_length"] if isinstance(batch, int) and isinstance(r.get("max_length"), int) else None
    precision = f"{r.get('precision')} (precision={r.get('precision_requested')})"
    if r.get("bf16_emulated"):
        precision += " EMULATED on this hardware: slower than fp32; precision=auto is faster (see the warning below)"
    lr = r.get("lr_chosen")
    sources = {"auto": "lr=auto: by model size", "config": "lr= on the command line or in the config",
               "auto-adapter": "lr=auto with adapters: the QLoRA paper's 2e-4 (1e-4 above ~20B)"}
    source = sources.get(str(r.get("lr_source")), str(r.get("lr_source")))
    resumed = f", resuming at step {r['step']}" if r.get("step") else ""
    shares = r.get("data_mix_shares")
    data = f"{r.get('data')} mix of {len(shares)} sources ({' / '.join(f'{s:.1%}' for s in shares)} of the " \
        "examples)" if shares else r.get("data")
    lines = [
        f"run        {r.get('run_dir')}  (console log: llmexp.log)",
        f"model      {model}, {params:,.2f}M parameters",
        f"data       {data}: {_count(r.get('data_train_tokens'))} train tokens in "
        f"{_count(r.get('data_train_examples'))} examples{eval_tokens} ({cache}, {r.get('data_prep_s', 0):.1f} s)",
        f"steps      {r.get('max_steps')}{resumed}; global batch {batch} = {micro} per device x {world} process(es) "
        f"x {accum} accumulation step(s)" + (f", {tokens:,} tokens/step" if tokens else ""),
        *([_auto_batch_line(r["batch_size_auto"])] if isinstance(r.get("batch_size_auto"), dict) else []),
        f"precision  {precision}",
        f"optimizer  {r.get('optimizer')}, lr {lr:.2e} ({source}), {r.get('scheduler')} schedule"
        if isinstance(lr, float) else f"optimizer  {r.get('optimizer')}, {r.get('scheduler')} schedule",
    ]
    return "\n".join(lines)


def _auto_batch_line(a: dict[str, Any]) -> str:
    """How batch_size=auto chose the micro-batch (the `start` record's `batch_size_auto`)."""
    if a.get("source") == "checkpoint":
        return f"batch      batch_size=auto: {a.get('chosen')}, as chosen before the checkpoint (not probed again)"
    if a.get("note"):
        return f"batch      batch_size=auto: {a.get('chosen')} per device ({a['note']})"
    probed = ", ".join(f"{p.get('micro')} {'fits' if p.get('fits') else 'too large'} ({p.get('peak_mb', 0):,.0f} MiB)"
                       for p in a.get("probed", []))
    return (f"batch      batch_size=auto: {a.get('chosen')} per device (estimate allows up to {a.get('upper_bound')} "
            f"of {a.get('budget_mb', 0):,.0f} MiB; probed {probed or 'on another rank'} "
            f"in {a.get('search_s', 0):.1f} s)")


def format_line(r: dict[str, Any]) -> str | None:
    """The console text of a record: the header (start), the dense line of a train or eval record, a finding."""
    if r.get("event") == "start" and "run_dir" in r:
        return format_header(r)
    if r.get("event") == "train":
        extra = f" | scale {r['loss_scale']:.0f}" if "loss_scale" in r else ""
        mfu = f"{r['mfu']:.1%}" if isinstance(r.get("mfu"), float) else "–"
        return (f"step {r['step']:>6} | loss {r['loss']:.4f} | ppl {r['ppl']:9.2f} | lr {r['lr']:.2e} | "
                f"grad {r['grad_norm']:.3f} | {r['tokens_per_sec']:,.0f} tok/s | mfu {mfu}{extra}")
    if r.get("event") == "eval":
        return f"eval {r['step']:>6} | eval_loss {r['eval_loss']:.4f} | eval_ppl {r['eval_ppl']:.2f}"
    if r.get("event") == "finding":
        return f"[{r['severity']}] step {r['step']}: {r['message']} -> {r['advice']}"
    if r.get("event") == "sample":
        return "\n".join(f"sample {r['step']:>4} | {s['prompt']!r} -> {s['completion']!r}" for s in r["samples"])
    return None


# ----------------------------------------------------------------------------- optional sinks: wandb, tensorboard

_log = logging.getLogger(__name__)
DEFAULT_INIT_TIMEOUT_S = 10.0
"""The default of `logger.init_timeout_s`, for sink configs made without the schema."""

__all__ = ["REDACTED", "TensorBoardSink", "WandbSink", "is_secret_key", "run_name_from_overrides", "scrub",
           "scrub_overrides", "wandb_mode"]


def run_name_from_overrides(overrides: list[str] | str, max_len: int = 128) -> str:
    """A readable run name from the overrides (`lr=1e-3,batch_size=4`), secrets removed; `default` if none."""
    items = overrides.split(",") if isinstance(overrides, str) else list(overrides)
    items = [o for o in scrub_overrides([o for o in items if o]) if not o.lstrip("+~").startswith("hydra.")]
    name = ",".join(items) or "default"
    return name if len(name) <= max_len else name[:max_len - 3] + "..."


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a train or eval record, under `train/` or `eval/`; NaN/inf kept as floats."""
    event = record.get("event")
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
