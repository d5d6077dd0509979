"""The console: third-party lines kept out of it (they go to the job log, `llmexp.log`), the header, and
one dense line per record."""

from __future__ import annotations

import logging
import os
import select
from pathlib import Path
from typing import Any


class _OwnOrError(logging.Filter):
    """Console handlers pass llmexp's own records and third-party errors; third-party warnings and INFO lines are
    counted by the logger that sent them (the file handler of the job log still gets every record)."""

    held: dict[str, int] = {}  # noqa: RUF012 (one count per process, whichever handler saw the record)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.split(".")[0] == "llmexp" or record.levelno >= logging.ERROR:
            return True
        if record.levelno >= logging.WARNING and not getattr(record, "llmexp_held", False):
            record.llmexp_held = True  # counted once, however many console handlers see it
            self.held[record.name] = self.held.get(record.name, 0) + 1
        return False


def quiet_console() -> None:
    """Keep third-party warnings and INFO lines (bitsandbytes' missing kernels, transformers' deprecations,
    matplotlib's font cache, ...) out of the console; Hydra's job log (`llmexp.log`, a file handler on the root
    logger) still gets them. Python's `warnings` are routed through logging (`py.warnings`) for that."""
    # Off, then on: captureWarnings(True) does nothing when it was on already, and a `warnings.catch_warnings`
    # block that ended since (pytest wraps every test in one) has put the original showwarning back.
    logging.captureWarnings(False)
    logging.captureWarnings(True)
    _OwnOrError.held.clear()  # this run's: an in-process caller may start several
    for handler in logging.getLogger().handlers:
        console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
        if console and not any(isinstance(f, _OwnOrError) for f in handler.filters):
            handler.addFilter(_OwnOrError())


def held_warnings_note() -> str | None:
    """One console line for the third-party warnings kept out of it, or None when there were none."""
    held = _OwnOrError.held
    if not held:
        return None
    total = sum(held.values())
    return (f"note: {total} third-party warning{'s' if total > 1 else ''} went to llmexp.log only "
            f"(from {', '.join(sorted(held))})")


def job_log(run_dir: Path) -> tuple[logging.Logger, logging.Handler | None]:
    """(the logger that writes console lines to the job log, the handler this call opened or None).

    The job log is Hydra's: the root logger's file handlers inside the run directory (`hydra.job_logging`,
    by default `RUN_DIR/llmexp.log`). Without one (a run started in-process, or job logging turned off) llmexp
    opens `RUN_DIR/llmexp.log` itself, with the same secret filter.
    """
    from llmexp.rundir.redact import install_log_filter

    logger = logging.getLogger("llmexp.console")
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


def format_duration(seconds: float) -> str:
    """1h02m, 4m10s, 12s."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _count(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else "?"


def format_size(n: int) -> str:
    """134.5M, 4.9M, 123.2K, 6.74B: a parameter count at a glance."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


ADAPTER_NAMES = {"lora": "LoRA", "qlora": "QLoRA"}


def model_lines(r: dict[str, Any]) -> list[str]:
    """What the model is: its path or id and class, how it trains, its size (with adapters: what trains, and on how
    many modules), vocabulary and context length (the `start` record's model facts)."""
    how = "fine-tuning" if r.get("model_path") else "from scratch"
    source = f", from GGUF dequantised to {r['gguf_dtype']}" if r.get("gguf_dtype") else ""
    arch = r.get("architecture")
    head = f"{r.get('model_id') or r.get('model')}: {arch}{source}, {how}" if arch else f"{r.get('model')} ({how})"
    total, trainable = r.get("model_params"), r.get("trainable_params", r.get("num_params"))
    if not isinstance(total, int) or not isinstance(trainable, int) or total <= 0:
        return [f"model      {head}, {format_size(int(r.get('num_params') or 0))} parameters"]
    size = f"{format_size(total)} parameters"
    adapter = r.get("adapter")
    if isinstance(adapter, dict):
        size += (f", {format_size(trainable)} trainable ({trainable / total:.1%}, "
                 f"{ADAPTER_NAMES.get(adapter.get('method'), adapter.get('method'))} r={adapter.get('r')} on "
                 f"{adapter.get('modules')} modules)")
    elif trainable != total:
        size += f", {format_size(trainable)} trainable"
    shape = [f"vocabulary {v:,}" for v in [r.get("vocab_size")] if isinstance(v, int)]
    shape += [f"context {c:,}" for c in [r.get("context_length")] if isinstance(c, int)]
    return [f"model      {head}", f"           {size}" + (f"; {', '.join(shape)}" if shape else "")]


def format_header(r: dict[str, Any]) -> str:
    """The console's first lines, from the `start` record: where the run writes, what it trains on, how."""
    cache = "cache hit" if r.get("data_cache_hit") else "tokenised now, cached"
    if r.get("data_streaming"):
        cache = "streamed: tokenised as it trains, not cached"
    eval_tokens = f", {_count(r.get('data_eval_tokens'))} eval tokens" if "data_eval_tokens" in r else ""
    accum, world, micro = r.get("gradient_accumulation_steps"), r.get("world_size"), r.get("batch_size")
    batch = r.get("global_batch_size")
    tokens = batch * r["max_length"] if isinstance(batch, int) and isinstance(r.get("max_length"), int) else None
    precision = f"{r.get('precision')} (precision={r.get('precision_requested')})"
    if isinstance(m := r.get("cpu_matmul"), dict):  # where the fp32 CPU matmuls go (llmexp.model.cpu_matmul)
        precision += f"; matmuls through {'oneDNN' if m.get('path') == 'onednn' else 'torch'}: {m.get('reason')}"
    measured = f" ({r['bf16_slowdown']:.1f}x fp32's matmul time, measured here)" \
        if isinstance(r.get("bf16_slowdown"), float) else ""
    if r.get("bf16_emulation"):
        precision += f", emulated by llmexp on fp32 matmuls{measured}"
    elif r.get("bf16_emulated"):
        slower = not isinstance(r.get("bf16_slowdown"), float) or r["bf16_slowdown"] > 1.0
        precision += f" EMULATED on this hardware{measured}" + (": precision=auto is faster" if slower else "")
    lr = r.get("lr_chosen")
    sources = {"auto": "lr=auto: by model size" + (", / 10 to fine-tune" if r.get("model_path") else ""),
               "config": "lr= on the command line or in the config",
               "data": f"lr=auto: data={r.get('data')}'s lr for training from scratch",
               "auto-adapter": "lr=auto with adapters: the QLoRA paper's 2e-4 (1e-4 above ~20B)"}
    source = sources.get(str(r.get("lr_source")), str(r.get("lr_source")))
    resumed = f", resuming at step {r['step']}" if r.get("step") else ""
    shares = r.get("data_mix_shares")
    data = f"{r.get('data')} mix of {len(shares)} source{'s' * (len(shares or []) > 1)} (" \
        f"{' / '.join(f'{s:.1%}' for s in shares)} of the examples)" if shares else r.get("data")
    dropped = r.get("data_train_dropped_examples")
    lines = [
        f"run        {r.get('run_dir')}  (console log: llmexp.log)",
        *model_lines(r),
        f"data       {data}: {_count(r.get('data_train_tokens'))} train tokens in "
        f"{_count(r.get('data_train_examples'))} examples{eval_tokens} ({cache}, {r.get('data_prep_s', 0):.1f} s)",
        *([f"           warning: {dropped:,} of {_count(r.get('data_train_records'))} train records dropped, no "
           "completion token left within data.max_length (a prompt as long as that?); raise data.max_length or "
           "shorten them"] if isinstance(dropped, int) and dropped > 0 else []),
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
    if r.get("event") == "eval_task":
        metrics = " | ".join(f"{k} {v:.4g}" for k, v in r["metrics"].items())
        return f"task {r['step']:>6} | {r['task']} | {metrics} | {r['items']} items, {r['seconds']:.1f} s"
    if r.get("event") == "finding":
        return f"[{r['severity']}] step {r['step']}: {r['message']} -> {r['advice']}"
    if r.get("event") == "sample":
        return "\n".join(f"sample {r['step']:>4} | {s['prompt']!r} -> {s['completion']!r}" for s in r["samples"])
    return None


def silence_dead_stdio() -> None:
    """Point stdout and stderr at /dev/null where nobody reads them any more.

    `accelerate launch` (>= 1.16) tees its child's stderr through a pipe, so a kill -9 of it leaves the workers'
    stderr a pipe without a reader, and a closed terminal hangs up theirs. Every later write would raise (EPIPE,
    EIO): in the next console line, or in the checkpoint a stop is saving. Called where a write failed and where a
    stop begins; after it, the console's lines still reach the run's own log, llmexp.log. poll(2) tells without writing:
    a pipe without a reader reports POLLERR, a hung-up terminal or socket POLLHUP."""
    poller = select.poll()
    for fd in (1, 2):
        poller.register(fd, select.POLLOUT)
    dead = [fd for fd, events in poller.poll(0) if events & (select.POLLERR | select.POLLHUP | select.POLLNVAL)]
    if dead:
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in dead:
            os.dup2(null, fd)
        os.close(null)
