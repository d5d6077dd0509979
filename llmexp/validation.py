"""What a schema cannot express: value ranges, option names and cross-field rules of a composed config.

`validate(cfg)` runs after Hydra composed the config against `llmexp.config`'s schemas and before
anything loads; it reports every problem at once, each naming the key and the fix (exit 2). It is
a pure function of the config, so a config validates on any machine; what depends on the machine
is `llmexp.preflight.check_environment`'s. No torch here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from llmexp.errors import UserError

if TYPE_CHECKING:
    from llmexp.config import Config

# The names each group's options give themselves (`name:` in conf/<group>/*.yaml).
PRECISIONS = ("bf16", "fp16", "fp32", "auto")
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit", "lion", "lion8bit", "sgd")
SCHEDULERS = ("cosine", "linear", "constant", "wsd")
ANOMALY_POLICIES = ("stop", "skip", "rollback")
DATA_KINDS = ("stdlib", "stdlib_sft", "json", "text")
LOGGERS = ("jsonl", "wandb", "tensorboard")


class ConfigError(UserError):
    """A user's mistake in the config: the message names the key and the fix. Exit code 2."""


def _check(errors: list[str], ok: bool, key: str, message: str) -> None:
    if not ok:
        errors.append(f"{key}: {message}")


def _choice(errors: list[str], value: str, key: str, choices: tuple[str, ...]) -> None:
    _check(errors, value in choices, key, f"{value!r} is not one of {', '.join(choices)}")


def parse_lr(value: Any) -> float | None:
    """`lr` as a float, None for `auto`; raises ValueError for anything else."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    if isinstance(value, bool):
        raise ValueError(value)
    return float(value)


def validate(cfg: DictConfig | Config) -> None:
    """Check ranges and cross-field rules; raise one ConfigError that lists every problem."""
    from llmexp.preflight import structure_errors

    errors: list[str] = structure_errors(cfg)  # ???, unknown keys, _target_s, interpolations
    if errors:  # the values below cannot be read or trusted until these are fixed
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    t = cfg.train
    try:
        lr = parse_lr(cfg.lr)
        _check(errors, lr is None or lr > 0, "lr", f"must be > 0 or auto, got {cfg.lr}; try lr=3e-4")
    except (TypeError, ValueError):
        errors.append(f"lr: {cfg.lr!r} is not a number or auto; try lr=3e-4 or lr=auto")
    _check(errors, cfg.batch_size > 0, "batch_size", f"must be >= 1, got {cfg.batch_size}")
    _check(errors, t.max_steps > 0 or t.max_steps == -1, "train.max_steps",
           f"must be >= 1, or -1 to use num_train_epochs; got {t.max_steps}")
    _check(errors, t.max_steps != -1 or t.num_train_epochs > 0, "train.num_train_epochs",
           f"must be > 0 when train.max_steps=-1, got {t.num_train_epochs}")
    _check(errors, t.gradient_accumulation_steps >= 1, "train.gradient_accumulation_steps",
           f"must be >= 1, got {t.gradient_accumulation_steps}")
    _check(errors, t.global_batch_size is None or t.global_batch_size > 0, "train.global_batch_size",
           f"must be >= 1 or null, got {t.global_batch_size}")
    _check(errors, t.max_grad_norm >= 0, "train.max_grad_norm", f"must be >= 0 (0 disables), got {t.max_grad_norm}")
    _check(errors, 0 <= t.warmup_ratio < 1, "train.warmup_ratio", f"must be in [0, 1), got {t.warmup_ratio}")
    warmup = t.warmup_steps if t.warmup_steps is not None else int(t.warmup_ratio * max(t.max_steps, 0))
    _check(errors, warmup >= 0, "train.warmup_steps", f"must be >= 0, got {warmup}")
    _check(errors, t.max_steps == -1 or warmup < t.max_steps, "train.warmup_steps",
           f"warmup ({warmup} steps) must be shorter than train.max_steps={t.max_steps}; "
           "lower train.warmup_steps/warmup_ratio or raise train.max_steps")
    _check(errors, t.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {t.weight_decay}")
    for key in ("logging_steps", "eval_steps"):
        value = t[key] if isinstance(t, DictConfig) else getattr(t, key)
        _check(errors, value > 0, f"train.{key}", f"must be >= 1, got {value}")
    _check(errors, t.eval_batches > 0 or t.eval_batches == -1, "train.eval_batches",
           f"must be >= 1 or -1 (all), got {t.eval_batches}")
    _check(errors, t.save_steps >= 0, "train.save_steps", f"must be >= 0 (0: only at the end), got {t.save_steps}")
    _check(errors, t.save_total_limit >= 1, "train.save_total_limit", f"must be >= 1, got {t.save_total_limit}")
    _choice(errors, t.on_anomaly, "train.on_anomaly", ANOMALY_POLICIES)
    _check(errors, 0 < t.rollback_lr_factor <= 1, "train.rollback_lr_factor",
           f"must be in (0, 1], got {t.rollback_lr_factor}")
    _check(errors, t.early_stopping_patience >= 0, "train.early_stopping_patience",
           f"must be >= 0 (0 disables), got {t.early_stopping_patience}")
    _check(errors, t.resume in ("auto", "never") or bool(t.resume), "train.resume",
           "must be auto, never, or a checkpoint path")
    _validate_groups(cfg, errors)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def _validate_groups(cfg: DictConfig | Config, errors: list[str]) -> None:
    from llmexp.preflight import remote_code_errors

    m, d = cfg.model, cfg.data
    _choice(errors, cfg.precision.name, "precision.name", PRECISIONS)
    _choice(errors, cfg.optimizer.name, "optimizer.name", OPTIMIZERS)
    _choice(errors, cfg.scheduler.name, "scheduler.name", SCHEDULERS)
    _choice(errors, d.name, "data.name", DATA_KINDS)
    _choice(errors, cfg.logger.name, "logger.name", LOGGERS)
    _check(errors, 0 <= cfg.scheduler.min_lr_ratio <= 1, "scheduler.min_lr_ratio",
           f"must be in [0, 1], got {cfg.scheduler.min_lr_ratio}")
    _check(errors, 0 < cfg.scheduler.decay_ratio <= 1, "scheduler.decay_ratio",
           f"must be in (0, 1], got {cfg.scheduler.decay_ratio}")
    _check(errors, d.max_length >= 2, "data.max_length", f"must be >= 2, got {d.max_length}")
    _check(errors, not d.finetune_only or bool(m.name_or_path), "model.name_or_path",
           f"data={d.name} fine-tunes an earlier model; set model.name_or_path=outputs/<date>/<time>/model")
    _check(errors, 0 < d.eval_fraction < 1, "data.eval_fraction", f"must be in (0, 1), got {d.eval_fraction}")
    _check(errors, d.num_proc >= 1, "data.num_proc", f"must be >= 1, got {d.num_proc}")
    _check(errors, d.name not in ("json", "text") or bool(d.train_file), "data.train_file",
           f"data={d.name} needs a training file; set data.train_file=path/to/train.jsonl")
    if m.name_or_path is None:
        _check(errors, m.hidden_size % m.num_attention_heads == 0, "model.hidden_size",
               f"{m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}")
        _check(errors, m.num_attention_heads % m.num_key_value_heads == 0, "model.num_key_value_heads",
               f"{m.num_key_value_heads} must divide model.num_attention_heads={m.num_attention_heads}")
        _check(errors, d.max_length <= m.max_position_embeddings, "data.max_length",
               f"{d.max_length} exceeds model.max_position_embeddings={m.max_position_embeddings}")
    errors.extend(remote_code_errors(m))  # trust_remote_code needs a pinned commit hash
    ds = cfg.deepspeed
    _check(errors, ds.stage in (0, 1, 2, 3), "deepspeed.stage", f"must be 0-3, got {ds.stage}")
    offload = ds.offload_optimizer != "none" or ds.offload_param != "none"
    _check(errors, not (offload and cfg.optimizer.name.endswith("8bit")), "optimizer",
           f"{cfg.optimizer.name} keeps its state on the accelerator and cannot run under DeepSpeed "
           "CPU offload; use optimizer=adamw with deepspeed=zero2_offload, or deepspeed=zero2")
    _check(errors, not (ds.stage > 0 and cfg.train.on_anomaly == "rollback"), "train.on_anomaly",
           "rollback is not supported under DeepSpeed; use train.on_anomaly=skip or stop")
