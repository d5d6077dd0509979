"""How a run is saved to a checkpoint, resumed from one, and rolled back to one.

A checkpoint holds everything that decides the next step (docs/explanation/checkpoints-and-resume.md), so a
resumed run continues bitwise. One whose files verify but whose content does not fit this run is found out before
anything is applied (`_check_fits`), so `train.resume=auto` falls back to the previous one; when none fits
because each holds another model or optimizer layout (the config changed), the resume is refused (exit 2) with
nothing rewritten, never trained over from scratch.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from accelerate.utils import broadcast_object_list, gather_object
from omegaconf import DictConfig

from llmexp.checkpoint import dcp, serialize
from llmexp.checkpoint import store as ckpt
from llmexp.errors import UserError, first_line
from llmexp.rundir.readers import Damaged, MiB, parse_json, read_bytes, read_text
from llmexp.train.engines.deepspeed import zero_world_mismatch
from llmexp.train.state import LoopState, Run, RunDescription

TRAINER_STATE = "trainer_state.json"


def save_state_checkpoint(run: Run) -> bool:
    """Save `checkpoints/step_<N>/` atomically (rank 0 writes; every rank's RNG is gathered). False on every rank
    when the disk was full (reported; older checkpoints kept): the run must stop as `failed`, not go on without a
    way back."""
    cfg, rt, model, state, log, engine = run.cfg, run.rt, run.model, run.state, run.log, run.engine
    # a stream's position is not a function of the step: it is saved
    state.data_state = run.train_data.position(state.step + state.data_offset, run.desc.plan.global_batch)
    rng_states = gather_object([serialize.capture_rng()]) if rt.world > 1 else [serialize.capture_rng()]
    write_optimizer = engine.optimizer_writer(run.optimizer, rt.run_dir, state.step)  # ZeRO: collective
    weights = engine.full_weights(model)  # ZeRO-3: gathered (collective); else None
    full: ckpt.DiskFull | None = None
    if rt.is_main:
        def write(tmp: Path) -> None:
            tensors = weights if weights is not None else engine.checkpoint_weights(model)
            if tensors:  # FSDP: the weights are in dcp/, with the optimizer state
                serialize.save_tensors(tmp / "model.safetensors", tensors)
            write_optimizer(tmp)
            for rank, rng in enumerate(rng_states):
                serialize.save_state(tmp / serialize.rng_filename(rank), rng)
            payload = {"state": asdict(state), "history": log.history}
            (tmp / TRAINER_STATE).write_text(json.dumps(payload, default=str))

        try:
            ckpt.save_checkpoint(rt.run_dir / "checkpoints", state.step, write, keep=cfg.train.save_total_limit,
                                 best_step=state.best_eval_step if state.best_eval_step >= 0 else None,
                                 extra={"resume_key": resume_key(cfg, run.desc)})
        except ckpt.DiskFull as err:
            full = err
            kept = [p.name for p in ckpt.list_checkpoints(rt.run_dir / "checkpoints")]
            log.write(f"error: {err}; the run stops (status failed). Kept: {', '.join(kept) or 'no checkpoint'}. "
                      "Free some space (or lower train.save_total_limit), then run the same command to resume.")
    return not rt.any_rank(full is not None)  # (a collective: every rank waits here for rank 0's save)


def _load_checked(run: Run, path: Path) -> dict[str, Any]:
    """Read (and so verify) every file of a checkpoint this rank needs, no pickle code running, and check that it
    fits the run (`_check_fits`), applying nothing yet. An FSDP checkpoint's `dcp/` has only its `.metadata` read
    here (a refusal falls back like any corrupt file); its shards are read by `FsdpEngine.load_state`."""
    rank, model_file, dcp_dir = run.rt.rank, path / "model.safetensors", path / dcp.DIR_NAME
    if dcp_dir.is_dir():
        dcp.read_metadata(dcp_dir)
    elif not model_file.exists():
        raise ckpt.CorruptCheckpoint(f"{model_file}: missing (and no dcp/ either)")
    states = {"optimizer": "optimizer.pt", "zero": f"zero_rank{rank}.pt",  # zero: this rank's ZeRO optimizer shard
              "rng": serialize.rng_filename(rank), "scaler": "scaler.pt"}
    payload = {"model": serialize.load_tensors(model_file) if model_file.exists() else None,
               "dcp": dcp_dir if dcp_dir.is_dir() else None,
               **{key: serialize.load_state(path / name) if (path / name).exists() else None
                  for key, name in states.items()},
               "trainer": _read_trainer_state(path / TRAINER_STATE)}
    _check_fits(run, path, payload)
    return payload


def _read_trainer_state(file: Path) -> dict[str, Any]:
    """trainer_state.json, checked against LoopState: a file that verifies but does not fit
    (invalid JSON, an unknown key, a value of the wrong type) is a CorruptCheckpoint naming it."""
    try:
        payload = parse_json(read_text(file, 64 * MiB), file)
    except (OSError, Damaged) as err:
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


_OTHER_MODEL_FIX = "resume with the model.* and peft settings it was saved with, or start over with train.resume=never"


class OtherLayout(ckpt.CorruptCheckpoint):
    """A checkpoint whose weights or parameter groups do not fit this run's: fallen back past as damage while an
    older one fits; the config's change, refused, when none does (`_found_checkpoint`)."""


def _check_fits(run: Run, path: Path, payload: dict[str, Any]) -> None:
    """Raise CorruptCheckpoint (`OtherLayout` for other weights or groups) unless the payload's weights (names,
    shapes) and optimizer state (groups, moment shapes) fit this run's model (why: the module's docstring)."""
    # another engine's: refused in its words (exit 2), not fallen back past, not an optimizer-group mismatch
    run.engine.refuse_other_kind(path, payload)
    saved = payload["model"]
    if saved is None or run.engine.sharded_checkpoints:  # FSDP's dcp/: dcp.load checks every shard's shape
        return
    live = run.engine.checkpoint_weights(run.model)
    file = path / "model.safetensors"
    missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
    if missing or unexpected:
        raise OtherLayout(f"{file}: does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]}); "
                          f"{_OTHER_MODEL_FIX}")
    if not run.engine.params_partitioned:  # ZeRO-3: no rank holds whole parameters to compare
        for name, tensor in saved.items():
            if (got := tuple(tensor.shape)) != (want := tuple(live[name].shape)):
                raise OtherLayout(f"{file}: {name} has shape {got}, the model's is {want}; {_OTHER_MODEL_FIX}")
    if payload["optimizer"] is not None:
        _check_optimizer_fits(run.optimizer, path / "optimizer.pt", payload["optimizer"])


def _check_optimizer_fits(optimizer: Any, file: Path, saved: Any) -> None:
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not (isinstance(groups, list) and isinstance(saved.get("state"), dict)):
        raise ckpt.CorruptCheckpoint(f"{file}: not an optimizer state (no 'state' and 'param_groups')")
    sizes = [len(g.get("params", [])) for g in groups if isinstance(g, dict)]
    live_sizes = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != live_sizes:
        raise OtherLayout(f"{file}: parameter groups of sizes {sizes} do not fit the optimizer's {live_sizes} "
                          "(model.parametrization, optimizer.decay_norms_and_biases or peft changed); "
                          f"{_OTHER_MODEL_FIX}")
    live = [p for g in optimizer.param_groups for p in g["params"]]
    by_id = dict(zip([i for g in groups for i in g["params"]], live, strict=True))
    for pid, entry in saved["state"].items():
        if pid not in by_id or not isinstance(entry, dict):
            raise ckpt.CorruptCheckpoint(f"{file}: state for unknown parameter {pid!r}")
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"):  # torch.optim's, parameter-shaped
            value, want = entry.get(key), tuple(by_id[pid].shape)
            if value is not None and (got := tuple(getattr(value, "shape", ()))) != want:
                raise ckpt.CorruptCheckpoint(f"{file}: {key} of parameter {pid} has shape {got}, the parameter's is "
                                             f"{want}")


def _apply_payload(run: Run, payload: dict[str, Any], path: Path) -> LoopState:
    """Load a checked payload into the model, optimizer, RNGs and scaler. A failure now would
    leave them half-loaded, so it ends the run (exit 2) rather than fall back or start fresh."""
    try:
        run.engine.load_state(run.model, run.optimizer, payload)
        if payload["rng"] is not None:
            serialize.restore_rng(payload["rng"])
        return LoopState(**payload["trainer"]["state"])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AssertionError) as err:
        raise ckpt.CorruptCheckpoint(
            f"{path}: passed its checks but could not be loaded ({type(err).__name__}: "
            f"{first_line(err, 300)}); resume from an older one with "
            "train.resume=<its path>, or start over with train.resume=never") from None


def resume_key(cfg: DictConfig, desc: RunDescription) -> dict[str, Any]:
    """The settings that shape the trajectory; a resume with other values is warned about.
    `data` is the token cache key (corpus content, tokenizer, data settings): a resume on other
    data is refused unless `train.resume_data_mismatch=warn`. The model's fields that change what it computes but
    not its parameters' shapes (a shape change fails the checkpoint's own checks) are there where they are used."""
    plan, m = desc.plan, cfg.model
    used = ("mup_base_width", "mup_input_mult", "mup_output_mult") if m.parametrization == "mup" else ()
    used += () if m.name_or_path else ("rope_theta", "attention_dropout")  # a loaded model keeps its own
    return {"lr": str(cfg.lr), "max_steps": cfg.train.max_steps, "global_batch": plan.global_batch,
            "batch_size": plan.micro, "world_size": plan.world, "seed": cfg.seed,
            "optimizer": cfg.optimizer.name, "scheduler": cfg.scheduler.name, "precision": desc.precision.name,
            "data": desc.data_fingerprint, "peft": cfg.peft.name, "base_model": base_model_fingerprint(cfg),
            "fsdp": cfg.fsdp.name, "parametrization": m.parametrization, "train.weight_decay": cfg.train.weight_decay,
            **{f"model.{k}": m[k] for k in used}}


KEPT_BY_THE_OPTIMIZER = ("train.weight_decay", "model.mup_base_width")
"""Settings a resume cannot change: they live in the param groups (muP's base width sets each group's `lr_mult`
and weight decay), which a checkpoint's optimizer state restores as they were saved."""


def base_model_fingerprint(cfg: DictConfig) -> str:
    """What identifies the pretrained base: its name, revision and, for a local directory, its config
    and the names and sizes of its weight files (cheap: no weight is read). With adapters a checkpoint
    holds no base weights, so resuming on another base would silently train a different model."""
    m = cfg.model
    if not m.name_or_path:
        return "from-config"
    parts = [str(m.name_or_path), str(m.revision)]
    directory = Path(m.name_or_path).expanduser()
    if m.gguf_file:  # the file itself is the base (its conversion is cached by content)
        gguf = directory / m.gguf_file
        parts.append(f"{m.gguf_file}:{gguf.stat().st_size if gguf.is_file() else 'hub'}")
    elif directory.is_dir():
        config = directory / "config.json"
        parts.append(read_bytes(config, None).decode(errors="replace") if config.is_file() else "")
        parts += sorted(f"{f.name}:{f.stat().st_size}" for f in directory.iterdir()
                        if f.suffix in (".safetensors", ".bin") and f.is_file())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _compare_resume_key(run: Run, path: Path) -> dict[str, Any]:
    """Warn about each trajectory setting that changed since the save; refuse other data (exit 2)
    unless told to go on. Runs on every rank, before anything is loaded or rewritten. Returns the saved key."""
    saved_key = ckpt.read_manifest(path).get("extra", {}).get("resume_key", {})
    for key, now in resume_key(run.cfg, run.desc).items():
        # world_size: `_check_world_size`; fsdp: `Engine.refuse_other_kind` (any fsdp option loads a dcp/ checkpoint)
        if key not in saved_key or saved_key[key] == now or key in ("world_size", "fsdp"):
            continue
        if key == "data":  # validation: resume_data_mismatch is error or warn
            what = (f"checkpoint {path} was saved with data fingerprint {saved_key[key]}, but this run's data has "
                    f"fingerprint {now} (the data files, the tokenizer or the data.* settings changed)")
            if run.cfg.train.resume_data_mismatch != "warn":
                raise UserError(f"{what}. Restore the original data, start over with train.resume=never, or set "
                                "train.resume_data_mismatch=warn to resume on the new data")
            run.log.write(f"warning: {what}; resuming anyway (train.resume_data_mismatch=warn)")
            continue
        if key in KEPT_BY_THE_OPTIMIZER:  # torch restores each param group's settings: the new value never applies
            raise UserError(f"checkpoint {path} was saved with {key}={saved_key[key]}, which its optimizer state "
                            f"keeps (each parameter group's weight decay and lr factor), so {key}={now} would not "
                            f"apply; resume with {key}={saved_key[key]}, or start over with train.resume=never")
        if key == "optimizer":  # another optimizer's state loads without complaint, then its first step raises
            raise UserError(f"checkpoint {path} holds {saved_key[key]}'s optimizer state, which optimizer={now} "
                            f"cannot take; resume with optimizer={saved_key[key]}, or start over with "
                            "train.resume=never")
        if key == "base_model" and run.cfg.peft.name != "none":
            raise UserError(f"checkpoint {path} holds adapters trained on another base model (fingerprint "
                            f"{saved_key[key]}, now {now}: model.name_or_path, its revision, config or weight "
                            "files changed). Point model.name_or_path at the original base, or start over "
                            "with train.resume=never")
        run.log.write(f"warning: resuming {path.name} with {key}={now}, but it was saved with {saved_key[key]}; "
                      "the run will not match an uninterrupted one")
    return saved_key


def _check_world_size(run: Run, saved: int | None) -> None:
    """Another number of processes than the save's: fine where the checkpoint reshards (DDP's state is
    replicated, FSDP's DCP reshards on load; the sampler cuts the same global batch for any world size).
    ZeRO cannot: exit 2 naming the rule, before anything is loaded."""
    plan = run.desc.plan
    if saved is None or saved == plan.world:
        return
    if run.engine.zero_checkpoints:
        raise zero_world_mismatch(saved, plan.world)
    run.log.write(f"resuming a checkpoint saved by {saved} process(es) on {plan.world}: the global batch is "
                  f"{plan.global_batch} as before, so the run continues as an uninterrupted {plan.world}-process "
                  "run would (up to fp32 reduction order)")


def _set_aside(run: Run) -> None:
    """`train.resume=never` in a directory with checkpoints: keep them, but out of this run's way."""
    rt, log = run.rt, run.log
    root = rt.run_dir / "checkpoints"
    if rt.is_main and ckpt.list_checkpoints(root):
        aside = root.with_name(f"checkpoints.before-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(root, aside)
        log.write(f"train.resume=never: moved the earlier checkpoints to {aside}")
    log.reset_history([])  # metrics.jsonl starts over with this run
    rt.accelerator.wait_for_everyone()


def _found_checkpoint(run: Run) -> tuple[Path, dict[str, Any]] | None:
    """Rank 0 picks the checkpoint (verifying hashes, falling back past bad ones); every rank loads it."""
    rt, choice, load = run.rt, run.cfg.train.resume, partial(_load_checked, run)
    if choice == "auto":
        notes: list[str] = []  # the fallback's warnings, said once it is known that the run goes on
        found, refusal = _newest_that_fits(run, notes.append) if rt.is_main else (None, None)
        path = str(found[0]) if found else None
        if rt.world > 1:  # rank 0's pick on every rank
            path, refusal = broadcast_object_list([path, refusal])
        if refusal is not None:
            raise UserError(refusal)
        for note in notes:
            run.log.write(note)
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


def _newest_that_fits(run: Run, warn: Callable[[str], None]
                      ) -> tuple[tuple[Path, dict[str, Any]] | None, str | None]:
    """(the newest checkpoint that verifies and fits, or None; the refusal when none does because they hold another
    layout: every checkpoint is the config's before it changed, and starting from scratch would train over them)."""
    layouts: list[str] = []

    def load(path: Path) -> dict[str, Any]:
        try:
            return _load_checked(run, path)
        except OtherLayout as err:
            layouts.append(str(err))
            raise

    found = ckpt.load_with_fallback(run.rt.run_dir / "checkpoints", load, warn)
    return found, (layouts[0] if found is None and layouts else None)


def saved_auto_batch(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """The batch_size=auto choice saved in the checkpoint a resume would start from (`train.resume`: auto is the
    newest here), read before any model exists so that a resumed run does not probe again. Unverified: a bad
    checkpoint is found out by `load_resume_state` later; here it only means probing again (None)."""
    choice = cfg.train.resume
    found = ckpt.list_checkpoints(run_dir / "checkpoints") if choice == "auto" else [Path(choice)]
    if choice == "never" or not found:
        return None
    try:  # (_read_trainer_state checks the choice is a dict, as LoopState's; {} where none was saved)
        return _read_trainer_state(found[-1] / TRAINER_STATE)["state"].get("batch_size_auto") or None
    except ckpt.CorruptCheckpoint:
        return None


def load_resume_state(run: Run) -> LoopState | None:
    """Resume per `train.resume`: auto (newest good checkpoint here), never, or a path: the checkpoint's loop state
    (`run.resumed_from_world_size` says how many processes saved it); None: start afresh."""
    if run.cfg.train.resume == "never":
        _set_aside(run)
        return None
    found = _found_checkpoint(run)
    if found is None:
        run.log.reset_history([])  # nothing to resume from: a killed attempt's lines would duplicate steps
        return None
    path, payload = found
    saved_world = _compare_resume_key(run, path).get("world_size")
    _check_world_size(run, saved_world)
    state = _apply_payload(run, payload, path)
    run.resumed_from_world_size = saved_world
    run.log.reset_history(payload["trainer"]["history"], state.step)
    run.log.log({"event": "resume", "step": state.step, "checkpoint": str(path), "world_size": run.desc.plan.world,
                 "resumed_from_world_size": saved_world})
    return state


def rollback(run: Run) -> None:
    """Back to the newest good checkpoint, past the data window that led to the anomaly, at a lower lr."""
    state, log = run.state, run.log
    found = ckpt.load_with_fallback(run.rt.run_dir / "checkpoints", partial(_load_checked, run), log.write,
                                    none_left="there is nothing to roll back to")
    if found is None:
        raise RuntimeError("rollback: no checkpoint to roll back to (one is saved at the start of the run)")
    path, payload = found
    bad_step = state.step
    restored = _apply_payload(run, payload, path)
    restored.rollbacks = state.rollbacks + 1
    restored.data_offset = state.data_offset + (bad_step - restored.step + 1)
    restored.lr_scale = state.lr_scale * run.cfg.train.rollback_lr_factor
    restored.skipped_steps, restored.seen_findings = state.skipped_steps, state.seen_findings
    state.__dict__.update(asdict(restored))
    log.log({"event": "rollback", "step": bad_step, "to_step": restored.step, "checkpoint": str(path),
             "lr_scale": restored.lr_scale, "data_offset": restored.data_offset})
