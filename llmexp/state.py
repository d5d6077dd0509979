"""What a run carries from step to step, and how it is saved, resumed, rolled back and finished.

A checkpoint holds everything that decides the next step, so a resumed run continues bitwise
where the saved one was: weights (safetensors), optimizer state, the fp16 scaler, every rank's
RNG states, and this loop state (step = the sampler position, data offset, lr scale, the
recent losses the spike detector looks at, and the metric history the detectors need).

A checkpoint whose files verify but whose content does not fit this run (an unknown key in the
trainer state, invalid JSON, a tensor of another shape) is found out before anything is applied,
so `train.resume=auto` falls back to the previous one. A full disk ends the run as `failed`,
with summary.json written if there is room for it, and the older checkpoints kept.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from llmexp import checkpoint as ckpt
from llmexp.errors import STATUS_EXIT, UserError
from llmexp.paths import write_json_atomic
from llmexp.rundir import last_value
from llmexp.security import scrub

if TYPE_CHECKING:
    import torch

    from llmexp.metrics import MetricsLogger
    from llmexp.runtime import Runtime

TRAINER_STATE = "trainer_state.json"


@dataclass
class LoopState:
    """Everything besides weights, optimizer and RNG that the next step depends on."""

    step: int = 0
    data_offset: int = 0
    lr_scale: float = 1.0
    rollbacks: int = 0
    skipped_steps: int = 0
    consecutive_anomalies: int = 0
    recent_losses: list[float] = field(default_factory=list)
    best_eval_loss: float = math.inf
    best_eval_step: int = -1
    evals_since_best: int = 0
    last_eval_step: int = -1
    num_examples: int = 0
    seen_findings: list[str] = field(default_factory=list)


def _lm(rt: Runtime, model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside the DDP/compile/loss wrappers.

    Accelerate's `unwrap_model` imports DeepSpeed whenever it is installed (a pause of up to
    seconds at the first checkpoint of every run); it is only needed under DeepSpeed.
    """
    if rt.deepspeed:
        return rt.accelerator.unwrap_model(model).lm
    inner = getattr(model, "_orig_mod", model)  # torch.compile
    return getattr(inner, "module", inner).lm  # DistributedDataParallel


def save_state_checkpoint(cfg: DictConfig, rt: Runtime, model: torch.nn.Module, optimizer: Any,
                          state: LoopState, log: MetricsLogger) -> bool:
    """Save `checkpoints/step_<N>/` atomically (rank 0 writes; every rank's RNG is gathered).

    Returns False on every rank when the disk was full (reported; older checkpoints kept): the
    run must stop as `failed` rather than go on without a way back.
    """
    from accelerate.utils import gather_object

    rng_states = gather_object([ckpt.capture_rng()]) if rt.plan.world > 1 else [ckpt.capture_rng()]
    zero_shards, weights = None, None
    if rt.deepspeed:  # each rank's ZeRO optimizer shard, saved without pickle; ZeRO-3 weights gathered
        from llmexp.zero import full_lm_state, stage_zero_shard

        zero_shards = stage_zero_shard(rt, optimizer, state.step)
        weights = full_lm_state(rt, model)
    full: ckpt.DiskFull | None = None
    if rt.is_main:
        def write(tmp: Path) -> None:
            tensors = weights if weights is not None else _lm(rt, model).state_dict()
            ckpt.save_tensors(tmp / "model.safetensors", tensors)
            if zero_shards is not None:
                from llmexp.zero import move_zero_shards

                move_zero_shards(zero_shards, tmp)
            else:
                ckpt.save_state(tmp / "optimizer.pt", optimizer.state_dict())
            for rank, rng in enumerate(rng_states):
                ckpt.save_state(tmp / ckpt.rng_filename(rank), rng)
            if rt.scaler is not None:
                ckpt.save_state(tmp / "scaler.pt", rt.scaler.state_dict())
            payload = {"state": asdict(state), "history": log.history}
            (tmp / TRAINER_STATE).write_text(json.dumps(payload, default=str))

        try:
            ckpt.save_checkpoint(rt.run_dir / "checkpoints", state.step, write, keep=cfg.train.save_total_limit,
                                 best_step=state.best_eval_step if state.best_eval_step >= 0 else None,
                                 extra={"resume_key": resume_key(cfg, rt)})
        except ckpt.DiskFull as err:
            full = err
            _report_disk_full(err, rt, log)
    rt.accelerator.wait_for_everyone()
    return not rt.any_rank(full is not None)


def _report_disk_full(err: ckpt.DiskFull, rt: Runtime, log: MetricsLogger) -> None:
    kept = [p.name for p in ckpt.list_checkpoints(rt.run_dir / "checkpoints")]
    log.write(f"error: {err}; the run stops (status failed). Kept: {', '.join(kept) or 'no checkpoint'}. "
              "Free some space (or lower train.save_total_limit), then run the same command to resume.")


def _load_payload(path: Path, rank: int) -> dict[str, Any]:
    """Read (and so verify) every file of a checkpoint this rank needs; no pickle code runs."""
    rng_file = path / ckpt.rng_filename(rank)
    zero_file = path / f"zero_rank{rank}.pt"  # DeepSpeed ZeRO: this rank's optimizer shard instead of optimizer.pt
    return {
        "model": ckpt.load_tensors(path / "model.safetensors"),
        "optimizer": ckpt.load_state(path / "optimizer.pt") if not zero_file.exists() else None,
        "zero": ckpt.load_state(zero_file) if zero_file.exists() else None,
        "rng": ckpt.load_state(rng_file) if rng_file.exists() else None,
        "scaler": ckpt.load_state(path / "scaler.pt") if (path / "scaler.pt").exists() else None,
        "trainer": _read_trainer_state(path / TRAINER_STATE),
    }


def _read_trainer_state(file: Path) -> dict[str, Any]:
    """trainer_state.json, checked against LoopState: a file that verifies but does not fit
    (invalid JSON, an unknown key, a value of the wrong type) is a CorruptCheckpoint naming it."""
    try:
        payload = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ckpt.CorruptCheckpoint(f"{file}: not valid JSON ({err})") from None
    if not (isinstance(payload, dict) and isinstance(payload.get("state"), dict)
            and isinstance(payload.get("history"), list) and all(isinstance(r, dict) for r in payload["history"])):
        raise ckpt.CorruptCheckpoint(f"{file}: expected {{'state': {{...}}, 'history': [{{...}}, ...]}}")
    defaults = asdict(LoopState())
    for key, value in payload["state"].items():
        if key not in defaults:
            raise ckpt.CorruptCheckpoint(f"{file}: unknown key {key!r} in the trainer state "
                                         "(written by another llmexp version?)")
        want = type(defaults[key])
        if not (isinstance(value, want) or (want is float and isinstance(value, int))):
            raise ckpt.CorruptCheckpoint(f"{file}: {key}={value!r} is not a {want.__name__}")
    return payload


def _check_fits(rt: Runtime, model: torch.nn.Module, optimizer: Any, path: Path, payload: dict[str, Any]) -> None:
    """Raise CorruptCheckpoint unless the payload's weights (names, shapes) and optimizer state
    (groups, moment shapes) fit this run's model, so nothing is applied from a checkpoint that
    would fail half-way through loading."""
    live = _lm(rt, model).state_dict()
    saved = payload["model"]
    file = path / "model.safetensors"
    missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
    if missing or unexpected:
        raise ckpt.CorruptCheckpoint(f"{file}: does not fit the model (missing {missing[:3]}, unexpected "
                                     f"{unexpected[:3]})")
    if not rt.deepspeed:  # under ZeRO-3 the live parameters are partitioned: no shapes to compare
        for name, tensor in saved.items():
            if tuple(tensor.shape) != tuple(live[name].shape):
                raise ckpt.CorruptCheckpoint(f"{file}: {name} has shape {tuple(tensor.shape)}, the model's is "
                                             f"{tuple(live[name].shape)}")
    if payload["optimizer"] is not None:
        _check_optimizer_fits(optimizer, path / "optimizer.pt", payload["optimizer"])


_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
"""torch.optim state entries shaped like their parameter."""


def _check_optimizer_fits(optimizer: Any, file: Path, saved: Any) -> None:
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not (isinstance(groups, list) and isinstance(saved.get("state"), dict)):
        raise ckpt.CorruptCheckpoint(f"{file}: not an optimizer state (no 'state' and 'param_groups')")
    live = optimizer.param_groups
    sizes = [len(g.get("params", [])) for g in groups if isinstance(g, dict)]
    if sizes != [len(g["params"]) for g in live]:
        raise ckpt.CorruptCheckpoint(f"{file}: parameter groups of sizes {sizes} do not fit the optimizer's "
                                     f"{[len(g['params']) for g in live]}")
    params = [p for g in live for p in g["params"]]
    ids = [i for g in groups for i in g["params"]]
    by_id = dict(zip(ids, params, strict=True))
    for pid, entry in saved["state"].items():
        if pid not in by_id or not isinstance(entry, dict):
            raise ckpt.CorruptCheckpoint(f"{file}: state for unknown parameter {pid!r}")
        for key in _MOMENTS:
            value = entry.get(key)
            if value is not None and tuple(getattr(value, "shape", ())) != tuple(by_id[pid].shape):
                raise ckpt.CorruptCheckpoint(f"{file}: {key} of parameter {pid} has shape "
                                             f"{tuple(getattr(value, 'shape', ()))}, the parameter's is "
                                             f"{tuple(by_id[pid].shape)}")


def _apply_payload(rt: Runtime, model: torch.nn.Module, optimizer: Any, payload: dict[str, Any],
                   path: Path) -> LoopState:
    """Load a checked payload into the model, optimizer, RNGs and scaler. A failure now would
    leave them half-loaded, so it ends the run (exit 2) rather than fall back or start fresh."""
    try:
        return _apply(rt, model, optimizer, payload)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as err:
        raise ckpt.CorruptCheckpoint(
            f"{path}: passed its checks but could not be loaded ({type(err).__name__}: "
            f"{(str(err).strip().splitlines() or [''])[0][:300]}); resume from an older one with "
            "train.resume=<its path>, or start over with train.resume=never") from None


def _apply(rt: Runtime, model: torch.nn.Module, optimizer: Any, payload: dict[str, Any]) -> LoopState:
    if rt.deepspeed or payload["zero"] is not None:
        from llmexp.zero import gathered_for_load, load_zero_shard

        with gathered_for_load(rt, model):  # ZeRO-3: the parameters are partitioned
            _lm(rt, model).load_state_dict(payload["model"])
        load_zero_shard(rt, optimizer, payload)
    else:
        _lm(rt, model).load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
    if payload["rng"] is not None:
        ckpt.restore_rng(payload["rng"])
    if rt.scaler is not None and payload["scaler"] is not None:
        rt.scaler.load_state_dict(payload["scaler"])
    return LoopState(**payload["trainer"]["state"])


def resume_key(cfg: DictConfig, rt: Runtime) -> dict[str, Any]:
    """The settings that shape the trajectory; a resume with other values is warned about.
    `data` is the token cache key (corpus content, tokenizer, data settings): a resume on other
    data is refused unless `train.resume_data_mismatch=warn`."""
    return {"lr": str(cfg.lr), "max_steps": cfg.train.max_steps, "global_batch": rt.plan.global_batch,
            "batch_size": cfg.batch_size, "world_size": rt.plan.world, "seed": cfg.seed,
            "optimizer": cfg.optimizer.name, "scheduler": cfg.scheduler.name, "precision": rt.precision,
            "data": rt.data_fingerprint}


def _compare_resume_key(cfg: DictConfig, rt: Runtime, path: Path, log: MetricsLogger) -> None:
    """Warn about each trajectory setting that changed since the save; refuse other data (exit 2)
    unless told to go on. Runs on every rank, before anything is loaded or rewritten."""
    saved_key = ckpt.read_manifest(path).get("extra", {}).get("resume_key", {})
    for key, now in resume_key(cfg, rt).items():
        if key not in saved_key or saved_key[key] == now:
            continue
        if key == "data":
            _data_mismatch(cfg, path, saved_key[key], now, log)
            continue
        log.write(f"warning: resuming {path.name} with {key}={now}, but it was saved with {saved_key[key]}; "
                  "the run will not match an uninterrupted one")


def _data_mismatch(cfg: DictConfig, path: Path, saved: str, now: str, log: MetricsLogger) -> None:
    what = (f"checkpoint {path} was saved with data fingerprint {saved}, but this run's data has fingerprint {now} "
            "(the data files, the tokenizer or the data.* settings changed)")
    if cfg.train.resume_data_mismatch == "warn":
        log.write(f"warning: {what}; resuming anyway (train.resume_data_mismatch=warn)")
        return
    raise UserError(f"{what}. Restore the original data, start over with train.resume=never, or set "
                    "train.resume_data_mismatch=warn to resume on the new data"
                    + ("" if cfg.train.resume_data_mismatch == "error" else
                       f" (train.resume_data_mismatch={cfg.train.resume_data_mismatch!r} is neither error nor warn)"))


def _set_aside(rt: Runtime, log: MetricsLogger) -> None:
    """`train.resume=never` in a directory with checkpoints: keep them, but out of this run's way."""
    root = rt.run_dir / "checkpoints"
    if rt.is_main and ckpt.list_checkpoints(root):
        aside = root.with_name(f"checkpoints.before-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(root, aside)
        log.write(f"train.resume=never: moved the earlier checkpoints to {aside}")
    log.reset_history([])  # metrics.jsonl starts over with this run
    rt.accelerator.wait_for_everyone()


def _broadcast(rt: Runtime, value: Any) -> Any:
    """Rank 0's value on every rank."""
    if rt.plan.world == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value])[0]


def _found_checkpoint(cfg: DictConfig, rt: Runtime, model: torch.nn.Module, optimizer: Any,
                      log: MetricsLogger) -> tuple[Path, dict[str, Any]] | None:
    """Rank 0 picks the checkpoint (verifying hashes, falling back past bad ones); every rank loads it."""
    choice = cfg.train.resume

    def load(p: Path) -> dict[str, Any]:
        payload = _load_payload(p, rt.rank)
        _check_fits(rt, model, optimizer, p, payload)
        return payload

    if choice == "auto":
        found = ckpt.load_with_fallback(rt.run_dir / "checkpoints", load, log.write) if rt.is_main else None
        path = _broadcast(rt, str(found[0]) if found else None)
        if path is None:
            return None
        return Path(path), (found[1] if found else load(Path(path)))
    path = Path(choice)
    if not (path / ckpt.MANIFEST).is_file():
        raise ckpt.CorruptCheckpoint(f"train.resume={choice}: not a complete checkpoint directory "
                                     "(no manifest.json); use train.resume=auto or a checkpoints/step_<N> dir")
    if rt.is_main:
        ckpt.verify_checkpoint(path, full=True)
    return path, load(path)


def load_resume_state(cfg: DictConfig, rt: Runtime, model: torch.nn.Module, optimizer: Any,
                      log: MetricsLogger) -> LoopState | None:
    """Resume per `train.resume`: auto (newest good checkpoint here), never, or a path."""
    if cfg.train.resume == "never":
        _set_aside(rt, log)
        return None
    found = _found_checkpoint(cfg, rt, model, optimizer, log)
    if found is None:
        log.reset_history([])  # nothing to resume from: a killed attempt's lines would duplicate steps
        return None
    path, payload = found
    _compare_resume_key(cfg, rt, path, log)
    state = _apply_payload(rt, model, optimizer, payload, path)
    log.reset_history(payload["trainer"]["history"])
    log.log({"event": "resume", "step": state.step, "checkpoint": str(path)})
    return state


def rollback(cfg: DictConfig, rt: Runtime, model: torch.nn.Module, optimizer: Any, state: LoopState,
             log: MetricsLogger) -> None:
    """Back to the newest good checkpoint, past the data window that led to the anomaly, at a lower lr."""
    def load(p: Path) -> dict[str, Any]:
        payload = _load_payload(p, rt.rank)
        _check_fits(rt, model, optimizer, p, payload)
        return payload

    found = ckpt.load_with_fallback(rt.run_dir / "checkpoints", load, log.write)
    if found is None:
        raise RuntimeError("rollback: no checkpoint to roll back to (one is saved at the start of the run)")
    path, payload = found
    bad_step = state.step
    restored = _apply_payload(rt, model, optimizer, payload, path)
    restored.rollbacks = state.rollbacks + 1
    restored.data_offset = state.data_offset + (bad_step - restored.step + 1)
    restored.lr_scale = state.lr_scale * cfg.train.rollback_lr_factor
    restored.skipped_steps, restored.seen_findings = state.skipped_steps, state.seen_findings
    state.__dict__.update(asdict(restored))
    log.log({"event": "rollback", "step": bad_step, "to_step": restored.step, "checkpoint": str(path),
             "lr_scale": restored.lr_scale, "data_offset": restored.data_offset})


def save_final_model(rt: Runtime, model: torch.nn.Module, tokenizer: Any,
                     weights: dict[str, torch.Tensor] | None = None) -> None:
    """`model/`: save_pretrained of the model and tokenizer, published by one atomic swap."""
    final = rt.run_dir / "model"
    tmp = rt.run_dir / ".model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _lm(rt, model).save_pretrained(tmp, safe_serialization=True, state_dict=weights)  # weights: ZeRO-3 gathered
        tokenizer.save_pretrained(tmp)
        ckpt.publish_dir(tmp, final)  # fsyncs, then swaps atomically: model/ is never missing or half-written
    except Exception as err:
        full = ckpt.disk_full_error(err, final)
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from None
        raise


def finish_run(cfg: DictConfig, rt: Runtime, model: torch.nn.Module, optimizer: Any, tokenizer: Any,
               state: LoopState, log: MetricsLogger, status: str, peak_lr: float, lr_source: str) -> dict[str, Any]:
    """Final checkpoint and model, summary.json, report; returns the summary.

    A full disk on the way turns the status into `failed` (exit 1); summary.json is still
    written if there is room for it."""
    if status in ("completed", "early_stopped"):
        status = _save_final(cfg, rt, model, optimizer, tokenizer, state, log, status)
    summary = build_summary(cfg, rt, state, log, status, peak_lr, lr_source)
    if rt.is_main:
        try:
            write_json_atomic(rt.run_dir / "summary.json", scrub(summary))
        except OSError as err:
            log.write(f"error: could not write {rt.run_dir / 'summary.json'}: {err}")
        _write_report(rt.run_dir, log)
        log.write(f"\n{status}: {rt.run_dir}\n" + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in summary.items() if k in ("step", "train_loss", "eval_loss", "eval_ppl", "tokens_per_sec")))
    log.close()
    rt.accelerator.wait_for_everyone()
    return summary


def _save_final(cfg: DictConfig, rt: Runtime, model: torch.nn.Module, optimizer: Any, tokenizer: Any,
                state: LoopState, log: MetricsLogger, status: str) -> str:
    """The final checkpoint and `model/`; returns the status, `failed` if the disk was full."""
    if not save_state_checkpoint(cfg, rt, model, optimizer, state, log):
        return "failed"
    from llmexp.zero import full_lm_state

    weights = full_lm_state(rt, model)  # ZeRO-3: collective, so every rank gathers; else None
    full: ckpt.DiskFull | None = None
    if rt.is_main:
        try:
            save_final_model(rt, model, tokenizer, weights)
        except ckpt.DiskFull as err:
            full = err
            log.write(f"error: {err}; model/ was not written (status failed). The final checkpoint "
                      f"step_{state.step} is complete: free some space and run the same command to export it.")
    return "failed" if rt.any_rank(full is not None) else status


def build_summary(cfg: DictConfig, rt: Runtime, state: LoopState, log: MetricsLogger, status: str,
                  peak_lr: float, lr_source: str) -> dict[str, Any]:
    """summary.json: the final status and metrics, and every finding with its advice."""
    from hydra.core.hydra_config import HydraConfig

    from llmexp.metrics import peak_memory_mb
    from llmexp.monitor import reconcile

    history = log.history
    findings = reconcile(history, rt.monitor_settings) if rt.is_main else []  # also what the console printed
    tokens_per_sec = rt.window.total_tokens / rt.window.total_seconds if rt.window.total_seconds else 0.0
    peak_mb = rt.reduce_max(peak_memory_mb(rt.device))  # the busiest rank's peak
    return {
        "status": status, "exit_code": STATUS_EXIT[status], "step": state.step,
        "train_loss": last_value(history, "train", "loss"), "eval_loss": last_value(history, "eval", "eval_loss"),
        "eval_ppl": last_value(history, "eval", "eval_ppl"), "best_eval_loss": state.best_eval_loss,
        "best_eval_step": state.best_eval_step, "tokens_per_sec": tokens_per_sec, "mfu": rt.mfu(tokens_per_sec),
        "lr": peak_lr, "lr_source": lr_source, "num_params": rt.num_params, "precision": rt.precision,
        "global_batch_size": rt.plan.global_batch, "gradient_accumulation_steps": rt.plan.accum,
        "world_size": rt.plan.world, "peak_mem_mb": peak_mb, "skipped_steps": state.skipped_steps,
        "rollbacks": state.rollbacks, "compile_time_s": rt.compile_time_s, "time_s": rt.elapsed(),
        "overrides": list(HydraConfig.get().overrides.task), "findings": findings,
    }


def _write_report(run_dir: Path, log: MetricsLogger) -> None:
    """report.md and curves.png; a failure here must not fail a finished run."""
    try:
        from llmexp.report import write_run_report

        write_run_report(run_dir)
    except Exception as err:  # a plotting problem is worth a warning, not a lost run
        log.write(f"warning: could not write the report: {err!r}")
