"""Throughput, MFU and memory, and the sinks every metric record goes to.

`metrics.jsonl` is always written (one JSON object per line, flushed, so a killed run keeps
every line it logged); the console gets a progress bar and one dense line per logging step;
wandb and tensorboard are optional sinks (`llmexp.sinks`). Only rank 0 logs.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from omegaconf import DictConfig


class Sink(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def make_sinks(cfg: DictConfig, run_dir: Path) -> list[Sink]:
    """The optional sink the `logger` group picks (wandb or tensorboard); jsonl is always on."""
    if cfg.logger.name == "wandb":
        from hydra.core.hydra_config import HydraConfig

        from llmexp.config import to_container
        from llmexp.sinks import WandbSink

        run_name = HydraConfig.get().job.override_dirname or "default"
        return [WandbSink(run_dir, to_container(cfg), run_name, cfg.logger)]
    if cfg.logger.name == "tensorboard":
        from llmexp.sinks import TensorBoardSink

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
        from llmexp.security import secret_env_values

        self.enabled = enabled
        self.sinks = sinks or []
        self._secrets = secret_env_values()  # no record (nor the history a checkpoint keeps) may hold one
        self.history: list[dict[str, Any]] = []
        self._file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8") if enabled else None  # noqa: SIM115
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stderr, disable=None if os.environ.get("LLMEXP_NO_BAR") != "1" else True)

    def log(self, record: dict[str, Any]) -> None:
        """Append a record (it must carry `event` and `step`)."""
        from llmexp.security import scrub

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
            self.write(line)

    def reset_history(self, records: list[dict[str, Any]]) -> None:
        """On resume: metrics.jsonl becomes exactly the checkpoint's history (later lines were lost work)."""
        self.history = list(records)
        if not self.enabled:
            return
        assert self._file is not None
        self._file.close()
        path = Path(self._file.name)
        tmp = path.with_name(".metrics.jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({k: _json_value(v) for k, v in r.items()}) + "\n" for r in records)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115
        if self._bar is not None and records:
            self._bar.n = max(int(r.get("step", 0)) for r in records)
            self._bar.refresh()

    def write(self, text: str) -> None:
        """Print above the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None and not self._bar.disable:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        for sink in self.sinks:
            sink.close()
        if self._file is not None:
            self._file.close()


def format_line(r: dict[str, Any]) -> str | None:
    """The dense console line of a train or eval record."""
    if r.get("event") == "train":
        extra = f" | scale {r['loss_scale']:.0f}" if "loss_scale" in r else ""
        return (f"step {r['step']:>6} | loss {r['loss']:.4f} | ppl {r['ppl']:9.2f} | lr {r['lr']:.2e} | "
                f"grad {r['grad_norm']:.3f} | {r['tokens_per_sec']:,.0f} tok/s | mfu {r['mfu']:.1%}{extra}")
    if r.get("event") == "eval":
        return f"eval {r['step']:>6} | eval_loss {r['eval_loss']:.4f} | eval_ppl {r['eval_ppl']:.2f}"
    if r.get("event") == "finding":
        return f"[{r['severity']}] step {r['step']}: {r['message']} -> {r['advice']}"
    return None
