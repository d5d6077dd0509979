"""What a schema cannot express: value ranges, option names and cross-field rules of a composed config.

`validate(cfg)` runs after Hydra composed the config against `llmexp.config.schema`'s schemas and before
anything loads; it reports every problem at once, each naming the key and the fix (exit 2). It is
a pure function of the config, so a config validates on any machine; what depends on the machine
is `llmexp.config.environment.check_environment`'s. No torch here.

Every number in the schema has a rule in `RANGES`: floats must be finite (nothing reads inf or NaN
as a setting; a key that does would be listed in `NON_FINITE_OK`), ints must fit the 64 bits that
torch and numpy take (`seed`: unsigned), and each has the bounds its meaning needs. A test walks the
schema so that a new field without a rule fails it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from llmexp.config.derived import parse_batch_size
from llmexp.errors import UserError

if TYPE_CHECKING:
    from llmexp.config.schema import Config

# The names each group's options give themselves (`name:` in llmexp/conf/<group>/*.yaml).
PRECISIONS = ("bf16", "fp16", "fp32", "auto")
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit", "lion", "lion8bit", "sgd")
SCHEDULERS = ("cosine", "linear", "constant", "wsd")
ANOMALY_POLICIES = ("stop", "skip", "rollback")
DATA_KINDS = ("stdlib", "stdlib_sft", "json", "text", "hf")
LOGGERS = ("jsonl", "wandb", "tensorboard")
PEFT_METHODS = ("none", "lora", "qlora")
FSDP_STRATEGIES = ("none", "full_shard", "shard_grad_op", "hybrid_shard")
SWEEP_STRATEGIES = ("grid", "random", "tpe")
PRUNERS = ("none", "asha", "hyperband", "median")
LR_SCALINGS = ("none", "sqrt", "linear")
EVAL_OPTIONS = ("loss", "demo", "perplexity", "multiple_choice", "generate", "lm_eval")
DIRECTIONS = ("minimize", "maximize")
RUN_METRICS = {"eval_loss": "minimize", "eval_ppl": "minimize"}
"""The metrics every run records at each eval, and which way is better."""
TASK_METRICS = {"perplexity": {"loss": "minimize", "ppl": "minimize"},
                "multiple_choice": {"acc": "maximize", "acc_norm": "maximize"},
                "generate": {"exact_match": "maximize", "contains": "maximize"}}
"""What each kind of task records (`tasks/<name>/<metric>`), and which way is better; the demo task is a
multiple_choice task named `demo`; harness tasks record the harness's own metric names."""

INT64_MAX = 2**63 - 1
"""The largest int torch, numpy and the checkpoint's JSON round trip all take as a signed 64-bit value."""
SEED_MAX = 2**64 - 1
"""torch.manual_seed and numpy's generators take seeds up to 2**64 - 1."""


class ConfigError(UserError):
    """A user's mistake in the config: the message names the key and the fix. Exit code 2."""


@dataclass(frozen=True)
class Range:
    """The values a number may take: `low`..`high` (each end closed unless `*_open`), plus `also`."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    also: tuple[int, ...] = ()
    """Values allowed outside the range, e.g. -1 for "all"."""
    note: str = ""
    """What a special value means, e.g. "(0 disables)"."""

    def contains(self, value: float) -> bool:
        if value in self.also:
            return True
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        if self.high == math.inf:
            text = f"must be {'>' if self.low_open else '>='} {_fmt(self.low)}"
        else:
            text = (f"must be in {'(' if self.low_open else '['}{_fmt(self.low)}, "
                    f"{_fmt(self.high)}{')' if self.high_open else ']'}")
        text += "".join(f" or {v}" for v in self.also)
        return f"{text} {self.note}" if self.note else text


def _at_least(low: float, note: str = "", also: tuple[int, ...] = ()) -> Range:
    return Range(low=low, note=note, also=also)


_POSITIVE = Range(low=0, low_open=True)
_FRACTION = Range(low=0, high=1, high_open=True)  # [0, 1)

RANGES: dict[str, Range] = {
    "model.hidden_size": _at_least(1),
    "model.num_hidden_layers": _at_least(1),
    "model.num_attention_heads": _at_least(1),
    "model.num_key_value_heads": _at_least(1),
    "model.intermediate_size": _at_least(1),
    "model.vocab_size": _at_least(1),
    "model.max_position_embeddings": _at_least(1),
    "model.rope_theta": _POSITIVE,
    "model.attention_dropout": _FRACTION,
    "data.max_length": _at_least(2),
    "data.eval_fraction": Range(low=0, high=1, low_open=True, high_open=True),
    "data.num_proc": _at_least(1),
    "data.max_examples": _at_least(1, "(or null for all)"),
    "data.shuffle_window": _at_least(1),
    "data.stream_eval_rows": _at_least(1),
    "precision.init_scale": _POSITIVE,
    "precision.growth_interval": _at_least(1),
    "optimizer.eps": _at_least(0),
    "optimizer.momentum": _FRACTION,
    "scheduler.min_lr_ratio": Range(low=0, high=1),
    "scheduler.decay_ratio": Range(low=0, high=1, low_open=True),
    "cluster.max_parallel": _at_least(1),
    "cluster.jobs_per_gpu": _at_least(1),
    "cluster.nodes": _at_least(1),
    "cluster.gpus_per_node": _at_least(0),
    "cluster.tasks_per_node": _at_least(1),
    "cluster.cpus_per_task": _at_least(1),
    "cluster.mem_gb": _at_least(1, "(or null for the partition's default)"),
    "cluster.timeout_min": _at_least(1),
    "cluster.signal_delay_s": _at_least(0),
    "cluster.max_num_timeout": _at_least(0),
    "cluster.array_parallelism": _at_least(1),
    "deepspeed.stage": Range(low=0, high=3),
    "logger.init_timeout_s": _POSITIVE,
    "peft.r": _at_least(1),
    "sweep.n_trials": _at_least(1),
    "sweep.parallel": _at_least(1),
    "sweep.seed": Range(low=0, high=SEED_MAX),
    "sweep.base_batch_size": _at_least(1, "(or null: the smallest batch_size swept)"),
    "peft.lora_alpha": _POSITIVE,
    "peft.lora_dropout": _FRACTION,
    "train.max_steps": _at_least(1, "(-1 trains for train.num_train_epochs)", also=(-1,)),
    "train.num_train_epochs": _POSITIVE,
    "train.gradient_accumulation_steps": _at_least(1),
    "train.global_batch_size": _at_least(1, "(or null)"),
    "train.max_grad_norm": _at_least(0, "(0 disables)"),
    "train.warmup_ratio": _FRACTION,
    "train.warmup_steps": _at_least(0, "(or null to use train.warmup_ratio)"),
    "train.weight_decay": _at_least(0),
    "train.logging_steps": _at_least(1),
    "train.eval_steps": _at_least(1),
    "train.eval_batches": _at_least(1, "(-1 evaluates the whole eval set)", also=(-1,)),
    "train.sample_steps": _at_least(0, "(0: only at the end)"),
    "train.sample_max_new_tokens": Range(low=1, high=4096),
    "train.sample_temperature": _at_least(0, "(0 decodes greedily)"),
    "train.sample_seed": Range(low=0, high=SEED_MAX),
    "train.save_steps": _at_least(0, "(0: only at the end)"),
    "train.save_total_limit": _at_least(1),
    "train.max_consecutive_anomalies": _at_least(1),
    "train.max_rollbacks": _at_least(0),
    "train.rollback_lr_factor": Range(low=0, high=1, low_open=True),
    "train.early_stopping_patience": _at_least(0, "(0 disables)"),
    "train.peak_tflops": Range(low=0, low_open=True, note="(or null to measure it)"),
    "train.seed_data": Range(low=0, high=SEED_MAX, note="(or null to use seed)"),
    "train.lr_find_steps": Range(low=5, high=100_000),
    "train.lr_find_start": Range(low=0, high=1, low_open=True),
    "train.lr_find_end": Range(low=0, high=1e3, low_open=True),
    "eval.demo_items": Range(low=0, high=100_000, note="(0: no demo task)"),
    "eval.batch_size": Range(low=1, high=4096),
    "eval.lm_eval.limit": _at_least(1, "(or null for every document)"),
    "eval.lm_eval.num_fewshot": Range(low=0, high=1000, note="(or null: each task's own)"),
    "eval.lm_eval.batch_size": Range(low=1, high=4096),
    "seed": Range(low=0, high=SEED_MAX),
}
"""The bounds of every int and float field of `llmexp.config.schema.Config` (`lr` is checked by `parse_lr`,
`batch_size` by `derived.parse_batch_size`)."""

NON_FINITE_OK: frozenset[str] = frozenset()
"""Float keys whose docstring gives inf or NaN a meaning; none does today."""

BETAS_RANGE = _FRACTION
"""Each of `optimizer.betas`."""


def _fmt(bound: float) -> str:
    return "2**64 - 1" if bound == SEED_MAX else "2**63 - 1" if bound == INT64_MAX else f"{bound:g}"


def _check(errors: list[str], ok: bool, key: str, message: str) -> None:
    if not ok:
        errors.append(f"{key}: {message}")


def _choice(errors: list[str], value: str, key: str, choices: tuple[str, ...]) -> None:
    _check(errors, value in choices, key, f"{value!r} is not one of {', '.join(choices)}")


def is_lr_find(value: Any) -> bool:
    """`lr=find`: a range test picks the lr (`llmexp.train.lr_find`)."""
    return isinstance(value, str) and value.strip().lower() == "find"


def parse_lr(value: Any) -> float | None:
    """`lr` as a float, None for `auto`; raises ValueError for anything else (`find` included: the trainer
    replaces it with the range test's pick before anything reads the lr)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    if isinstance(value, bool):
        raise ValueError(value)
    return float(value)


def _unwrap(tp: Any) -> Any:
    """`X | None` -> X."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else Any
    return tp


def schema_fields(cls: Any = None, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Every leaf of the schema: dotted key -> (type with `| None` removed, default or None)."""
    from llmexp.config.schema import Config

    cls = Config if cls is None else cls
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[Any, Any]] = {}
    for f in dataclasses.fields(cls):
        tp = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(tp):
            out.update(schema_fields(tp, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = (tp, None if f.default is dataclasses.MISSING else f.default)
    return out


def number_keys() -> dict[str, type]:
    """The int and float fields of the schema (each has a rule in `RANGES`)."""
    return {key: tp for key, (tp, _) in schema_fields().items() if tp in (int, float)}


def _deleted_node_errors(node: DictConfig, cls: Any = None, prefix: str = "") -> list[str]:
    """Keys of the schema that the config lacks: deleted with `~key` (or by a config file), and config
    groups with no option chosen (`~model` leaves `model` at ???)."""
    from llmexp.config.keys import group_options
    from llmexp.config.schema import Config

    cls = Config if cls is None else cls
    hints, errors = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if f.name not in node.keys():  # noqa: SIM118 (`in` is false for ???, which structure_errors reports)
            errors.append(f"{key}: is required but was deleted (by ~{key} or a config file); "
                          f"remove that deletion (python -m llmexp --cfg job shows the full config)")
        elif not prefix and OmegaConf.is_missing(node, f.name) and (options := group_options(f.name)):
            errors.append(f"{key}: no {key} is chosen (removed by ~{key}?); pick one, e.g. "
                          f"{key}={_default_option(key) or options[0]} (the options are {', '.join(options)})")
        elif dataclasses.is_dataclass(_unwrap(hints[f.name])) and not OmegaConf.is_missing(node, f.name):
            child = node[f.name]
            if isinstance(child, DictConfig):
                errors.extend(_deleted_node_errors(child, _unwrap(hints[f.name]), key + "."))
    return errors


def _default_option(group: str) -> str | None:
    """The option `llmexp/conf/config.yaml`'s defaults list picks for `group`."""
    from llmexp.config.tree import conf_dir

    defaults = OmegaConf.load(conf_dir() / "config.yaml").defaults
    return next((str(d[group]) for d in defaults if isinstance(d, DictConfig) and group in d), None)


def _number_problem(key: str, value: Any, tp: type, default: Any) -> str | None:
    """Why `value` is no good for the number field `key`, or None."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None  # null where the schema allows it; a wrong type is the schema's to report
    example = f"; e.g. {key}={default}" if default is not None else ""
    rng = RANGES[key]
    if tp is float and not math.isfinite(value) and key not in NON_FINITE_OK:
        return f"{key}: must be a finite number, got {value}{example}"
    limit = rng.high if rng.high != math.inf else INT64_MAX
    if tp is int and not -INT64_MAX - 1 <= value <= limit:
        bounds = rng.describe() + ("" if rng.high != math.inf else f" and at most {_fmt(limit)}")
        return f"{key}: {value} does not fit in 64 bits; {bounds}{example}"
    if not rng.contains(value):
        return f"{key}: {rng.describe()}, got {value}{example}"
    return None


def _number_errors(cfg: DictConfig) -> dict[str, str]:
    """key -> message for every int or float field out of its range (`RANGES`), `lr` and the betas."""
    fields = schema_fields()
    bad = {key: problem for key, tp in number_keys().items()
           if (problem := _number_problem(key, OmegaConf.select(cfg, key), tp, fields[key][1]))}
    try:
        lr = None if is_lr_find(cfg.lr) else parse_lr(cfg.lr)
        if lr is not None and not (math.isfinite(lr) and lr > 0):
            bad["lr"] = f"lr: must be > 0 and finite, or auto or find; got {cfg.lr}; try lr=3e-4"
    except (TypeError, ValueError):
        bad["lr"] = f"lr: {cfg.lr!r} is not a number, auto or find; try lr=3e-4, lr=auto or lr=find"
    try:
        parse_batch_size(cfg.batch_size)
    except ValueError:
        value = cfg.batch_size
        is_int = isinstance(value, int) and not isinstance(value, bool)
        bad["batch_size"] = (f"batch_size: must be >= 1 (or auto), got {value}; e.g. batch_size=4" if is_int else
                             f"batch_size={value}: must be an integer or auto; e.g. batch_size=4, or batch_size=auto "
                             "for the largest micro-batch that fits in memory")
    betas = cfg.optimizer.betas
    numbers = [b for b in betas if isinstance(b, int | float) and not isinstance(b, bool)]
    if len(betas) != 2 or len(numbers) != 2 or not all(math.isfinite(b) and BETAS_RANGE.contains(b) for b in numbers):
        shown = list(betas) if isinstance(betas, ListConfig) else betas
        bad["optimizer.betas"] = (f"optimizer.betas: must be two numbers in [0, 1), got {shown}; "
                                  "e.g. optimizer.betas=[0.9,0.999]")
    bad.update(_kwargs_errors(cfg.optimizer.kwargs, "optimizer.kwargs"))
    return bad


def _kwargs_errors(data: Any, key: str) -> dict[str, str]:
    """Free-form constructor arguments are passed as they are, so a float among them must be finite too."""
    if isinstance(data, DictConfig | ListConfig):
        items = data.items() if isinstance(data, DictConfig) else enumerate(data)
        return {k: v for name, value in items for k, v in _kwargs_errors(value, f"{key}.{name}").items()}
    if isinstance(data, float) and not math.isfinite(data):
        return {key: f"{key}: must be a finite number, got {data}"}
    return {}


def validate(cfg: DictConfig | Config) -> None:
    """Check ranges and cross-field rules; raise one ConfigError that lists every problem."""
    from llmexp.config.keys import structure_errors

    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    errors = _deleted_node_errors(cfg) or structure_errors(cfg)  # ~node, ???, unknown keys, _target_s, ${...}
    if errors:  # the values below cannot be read or trusted until these are fixed
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    bad = _number_errors(cfg)
    errors = list(bad.values())
    t = cfg.train
    if not bad.keys() & {"train.warmup_steps", "train.warmup_ratio", "train.max_steps"}:
        warmup = t.warmup_steps if t.warmup_steps is not None else int(t.warmup_ratio * max(t.max_steps, 0))
        _check(errors, t.max_steps == -1 or warmup < t.max_steps, "train.warmup_steps",
               f"warmup ({warmup} steps) must be shorter than train.max_steps={t.max_steps}; "
               "lower train.warmup_steps/warmup_ratio or raise train.max_steps")
    _choice(errors, t.on_anomaly, "train.on_anomaly", ANOMALY_POLICIES)
    _choice(errors, t.resume_data_mismatch, "train.resume_data_mismatch", ("error", "warn"))
    _check(errors, t.resume in ("auto", "never") or bool(t.resume), "train.resume",
           "must be auto, never, or a checkpoint path")
    _validate_groups(cfg, errors, bad.keys())
    if "batch_size" not in bad and parse_batch_size(cfg.batch_size) is None and cfg.deepspeed.stage > 0:
        errors.append(f"batch_size=auto does not work with deepspeed={cfg.deepspeed.name}: DeepSpeed fixes the "
                      "micro-batch in its config before the model exists; set batch_size to a number "
                      "(python -m llmexp.estimate batch_size=auto shows what fits)")
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def _validate_groups(cfg: DictConfig, errors: list[str], bad: typing.AbstractSet[str]) -> None:
    """Option names and the rules between fields; a rule reads only keys whose own range holds."""
    from llmexp.config.security import remote_code_errors

    m, d = cfg.model, cfg.data
    _choice(errors, cfg.precision.name, "precision.name", PRECISIONS)
    _choice(errors, cfg.optimizer.name, "optimizer.name", OPTIMIZERS)
    _choice(errors, cfg.scheduler.name, "scheduler.name", SCHEDULERS)
    _choice(errors, d.name, "data.name", DATA_KINDS)
    _choice(errors, cfg.logger.name, "logger.name", LOGGERS)
    _check(errors, not d.finetune_only or bool(m.name_or_path), "model.name_or_path",
           f"data={d.name} fine-tunes an earlier model; set model.name_or_path=outputs/<date>/<time>/model")
    _check(errors, d.name not in ("json", "text") or bool(d.train_file), "data.train_file",
           f"data={d.name} needs a training file; set data.train_file=path/to/train.jsonl")
    _check(errors, d.name != "hf" or bool(d.path) or bool(d.mix), "data.path",
           "data=hf needs a dataset: a hub id, a save_to_disk directory, or data.path=parquet with data.data_files "
           "(or several with data.mix=[{path: ..., weight: ...}, ...])")
    _validate_mix(d, errors)
    if d.streaming:
        _validate_streaming(cfg, errors, bad)
    heads = {"model.hidden_size", "model.num_attention_heads", "model.num_key_value_heads"}
    if m.name_or_path is None and not bad & heads:
        _check(errors, m.hidden_size % m.num_attention_heads == 0, "model.hidden_size",
               f"{m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}")
        _check(errors, m.num_attention_heads % m.num_key_value_heads == 0, "model.num_key_value_heads",
               f"{m.num_key_value_heads} must divide model.num_attention_heads={m.num_attention_heads}")
    if m.name_or_path is None and not bad & {"data.max_length", "model.max_position_embeddings"}:
        _check(errors, d.max_length <= m.max_position_embeddings, "data.max_length",
               f"{d.max_length} exceeds model.max_position_embeddings={m.max_position_embeddings}")
    errors.extend(remote_code_errors(m))  # trust_remote_code needs a pinned commit hash
    ds = cfg.deepspeed
    offload = ds.offload_optimizer != "none" or ds.offload_param != "none"
    _check(errors, not (offload and cfg.optimizer.name.endswith("8bit")), "optimizer",
           f"{cfg.optimizer.name} keeps its state on the accelerator and cannot run under DeepSpeed "
           "CPU offload; use optimizer=adamw with deepspeed=zero2_offload, or deepspeed=zero2")
    _check(errors, not (ds.stage > 0 and cfg.train.on_anomaly == "rollback"), "train.on_anomaly",
           "rollback is not supported under DeepSpeed; use train.on_anomaly=skip or stop")
    _check(errors, not (ds.stage >= 3 and cfg.train.sample_prompts), "train.sample_prompts",
           "samples need whole weights on one process, and ZeRO-3 partitions them; use deepspeed=zero2, or "
           "sample from model/ after the run")
    _validate_peft(cfg, errors)
    _validate_sweep(cfg.sweep, errors)
    _validate_fsdp(cfg, errors)
    _validate_eval(cfg, errors)
    _validate_lr_find(cfg, errors, bad)


def _validate_fsdp(cfg: DictConfig, errors: list[str]) -> None:
    """`fsdp`: the option name, and the combinations that cannot work, each with the reason and the fix."""
    fs = cfg.fsdp
    _choice(errors, fs.name, "fsdp.name", FSDP_STRATEGIES)
    if fs.name == "none":
        _check(errors, not fs.cpu_offload, "fsdp.cpu_offload",
               "offloads FSDP's shards, and fsdp=none shards nothing; use fsdp=full_shard fsdp.cpu_offload=true")
        return
    _check(errors, cfg.deepspeed.stage == 0, "deepspeed",
           f"fsdp={fs.name} and deepspeed={cfg.deepspeed.name} both shard the model; pick one: deepspeed=none "
           "with fsdp (its checkpoints resume on another number of processes), or fsdp=none with deepspeed")
    _check(errors, not cfg.optimizer.name.endswith("8bit"), "optimizer",
           f"{cfg.optimizer.name} keeps its state in bitsandbytes' own blocks, which FSDP cannot shard "
           "(bitsandbytes #1403); use optimizer=adamw (or lion) with fsdp, or fsdp=none")
    _check(errors, cfg.precision.name != "fp16", "precision",
           "fp16 under FSDP needs a sharded loss scaler, which llmexp does not wire; use precision=bf16 "
           "(or fp32), or fsdp=none for fp16")
    _check(errors, cfg.peft.name == "none", "peft",
           f"peft={cfg.peft.name} with fsdp is not supported: adapters and their optimizer state are small, "
           "so use fsdp=none (DDP for several GPUs)")
    _check(errors, cfg.train.on_anomaly != "rollback", "train.on_anomaly",
           "rollback is not supported under fsdp; use train.on_anomaly=skip or stop")
    _check(errors, not cfg.train.sample_prompts, "train.sample_prompts",
           "samples are generated on one process, and FSDP shards the weights over all of them; drop "
           "train.sample_prompts, or sample from model/ after the run")


def _validate_mix(d: DictConfig, errors: list[str]) -> None:
    """`data.mix`: hf sources only, instead of data.path, each with a share of at least 1 in MIX_ROUND."""
    from llmexp.config.derived import MIX_ROUND, mix_quotas

    if not d.mix:
        return
    _check(errors, d.name == "hf", "data.mix", f"mixes datasets read by data=hf; data={d.name} reads one source: "
           "use data=hf with data.mix, or drop data.mix")
    _check(errors, not d.path, "data.path", "data.path and data.mix both name the data; keep one (a one-source "
           "mix is data.path)")
    weights = [float(s.weight) for s in d.mix]
    for i, (source, w) in enumerate(zip(d.mix, weights, strict=True)):
        _check(errors, bool(source.path), f"data.mix[{i}].path", "names no dataset; set a hub id, a directory, or "
               "a file builder with data_files")
        _check(errors, math.isfinite(w) and w > 0, f"data.mix[{i}].weight", f"must be a positive number, got {w}")
    if all(math.isfinite(w) and w > 0 for w in weights):
        for i, q in enumerate(mix_quotas(weights)):
            _check(errors, q > 0, f"data.mix[{i}].weight", f"{weights[i]} gives this source less than one example "
                   f"in {MIX_ROUND}; raise it or drop the source")


def _validate_streaming(cfg: DictConfig, errors: list[str], bad: typing.AbstractSet[str]) -> None:
    """What `data.streaming=true` needs: it reads the split once, as it trains, and never whole."""
    d, t = cfg.data, cfg.train
    _check(errors, d.name == "hf", "data.streaming",
           f"streaming reads through the `datasets` library, so it needs data=hf (data={d.name} is read whole); "
           "use data=hf data.path=..., or set data.streaming=false")
    _check(errors, "train.max_steps" in bad or t.max_steps > 0, "train.max_steps",
           "a stream's length is unknown until it ends, so data.streaming=true needs a step count: set "
           "train.max_steps=N (train.num_train_epochs cannot be turned into steps)")
    _check(errors, bool(d.tokenizer or cfg.model.name_or_path), "data.tokenizer",
           "data.streaming=true cannot train a BPE on the whole split first: set data.tokenizer=<a tokenizer "
           "directory or hub id>, or model.name_or_path=<a model> to use its tokenizer")
    _check(errors, d.max_examples is None, "data.max_examples", "a stream is not read whole, so it cannot be cut "
           "to a number of records; set data.max_examples=null and bound the run with train.max_steps")
    _check(errors, not d.mix, "data.mix", "a streamed mixture is not implemented: stream one dataset "
           "(data.path), or drop data.streaming to mix cached datasets")
    _check(errors, t.on_anomaly != "rollback", "train.on_anomaly",
           "rollback is not supported with data.streaming=true (it skips ahead over data the stream would have to "
           "re-read from a checkpoint's window); use train.on_anomaly=skip or stop")


def _validate_sweep(sw: DictConfig, errors: list[str]) -> None:
    """The sweep's options: a pruner needs a search, pairing and lr scaling belong to the grid."""
    _choice(errors, sw.name, "sweep.name", SWEEP_STRATEGIES)
    _choice(errors, sw.pruner, "sweep.pruner", PRUNERS)
    _choice(errors, sw.lr_scaling, "sweep.lr_scaling", LR_SCALINGS)
    search = sw.name != "grid"
    _check(errors, search or sw.pruner == "none", "sweep.pruner",
           f"a pruner stops the trials of a search; use sweep=tpe (or random) with sweep.pruner={sw.pruner}, "
           "or drop sweep.pruner")
    _check(errors, not search or (not sw.zip and sw.lr_scaling == "none"), "sweep.zip",
           f"sweep.zip and sweep.lr_scaling shape a grid; sweep={sw.name} samples each key itself (drop them, or "
           "use sweep=grid)")


def _validate_peft(cfg: DictConfig, errors: list[str]) -> None:
    """The adapter options, and the combinations that cannot work, each with the reason."""
    pe = cfg.peft
    _choice(errors, pe.name, "peft.name", PEFT_METHODS)
    _choice(errors, pe.bnb_4bit_quant_type, "peft.bnb_4bit_quant_type", ("nf4", "fp4"))
    target = pe.target_modules
    _check(errors, target == "all-linear" or (isinstance(target, ListConfig) and len(target) > 0
                                              and all(isinstance(t, str) and t for t in target)),
           "peft.target_modules", f"must be all-linear or a list of module names, got {target!r}; "
           "e.g. peft.target_modules=[q_proj,v_proj]")
    if pe.name == "none":
        _check(errors, not pe.load_in_4bit, "peft.load_in_4bit",
               "a 4-bit base cannot be trained without adapters; use peft=qlora")
        _check(errors, not cfg.train.merge_adapter, "train.merge_adapter",
               "there is no adapter to merge with peft=none; use peft=lora, or drop train.merge_adapter")
        return
    if pe.load_in_4bit:
        _check(errors, bool(cfg.model.name_or_path), "model.name_or_path",
               f"peft={pe.name} loads a pretrained model in 4 bits; set model.name_or_path=<a model directory "
               "or hub id>")
    # llmexp's ZeRO checkpoints save every rank's optimizer partition and the whole model; an adapter-only
    # checkpoint and resume under ZeRO are not implemented, and ZeRO-3 cannot partition bitsandbytes' packed
    # 4-bit weights. One GPU or DDP (accelerate launch / torchrun, deepspeed=none) trains adapters.
    _check(errors, cfg.deepspeed.stage == 0, "deepspeed",
           f"peft={pe.name} does not run under DeepSpeed in llmexp (adapter-only ZeRO checkpoints are not "
           "implemented, and ZeRO cannot partition 4-bit weights); adapters and their optimizer state are "
           "small, so use deepspeed=none (DDP for several GPUs)")


# ----------------------------------------------------------------------------- eval tasks, sweep.metric, lr=find


def _validate_eval(cfg: DictConfig, errors: list[str]) -> None:
    """`eval`: the option name, every task's fields (each dict entry is a schema node, so its numbers are checked
    here), generation where the weights are whole, and `sweep.metric` against what the tasks record."""
    ev = cfg.eval
    _choice(errors, ev.name, "eval.name", EVAL_OPTIONS)
    names: list[str] = []
    for kind in ("perplexity", "multiple_choice", "generate"):
        for name, task in ev[kind].items():
            key = f"eval.{kind}.{name}"
            names.append(str(name))
            _check(errors, _task_name_ok(str(name)), key, "a task name must be letters, digits, _ . or - (it becomes "
                   "the metric name tasks/<name>/...)")
            if kind == "perplexity":
                _validate_perplexity_set(task, key, errors)
                continue
            _check(errors, isinstance(task.file, str) and bool(task.file), f"{key}.file",
                   f"names no task file; set {key}.file=path/to/{name}.jsonl")
            _bounded(errors, task.max_items, f"{key}.max_items", _at_least(1, "(or null for all)"))
            if kind == "generate":
                _bounded(errors, task.max_new_tokens, f"{key}.max_new_tokens", Range(low=1, high=4096))
                _bounded(errors, task.examples, f"{key}.examples", Range(low=0, high=1000))
                _check(errors, all(isinstance(x, str) for x in task.stop), f"{key}.stop",
                       f"must be a list of strings, e.g. {key}.stop=['\\n']")
    if ev.demo_items > 0:
        names.append("demo")
    _check(errors, len(names) == len(set(names)), "eval", f"task names must differ (demo is the demo task's); "
           f"got {', '.join(sorted(n for n in names if names.count(n) > 1))} twice")
    lm = ev.lm_eval
    _check(errors, all(isinstance(t, str) and _task_name_ok(t) for t in lm.tasks), "eval.lm_eval.tasks",
           "must be a list of harness task names, e.g. eval.lm_eval.tasks=[arc_easy,hellaswag]")
    if not lm.tasks:
        _check(errors, ev.name != "lm_eval", "eval.lm_eval.tasks", "eval=lm_eval names no task; set "
               "eval.lm_eval.tasks=[arc_easy] (and eval.lm_eval.include_path=DIR for your own task YAMLs)")
    whole_weights = cfg.fsdp.name == "none" and cfg.deepspeed.stage < 3
    _check(errors, whole_weights or not (ev.generate or lm.tasks), "eval", "generate and lm_eval tasks run on "
           f"whole weights, and {'fsdp' if cfg.fsdp.name != 'none' else 'ZeRO-3'} shards them; use "
           "multiple_choice or perplexity tasks, or score model/ after the run")
    _validate_metric(cfg, errors)


def _task_name_ok(name: str) -> bool:
    return bool(name) and all(c.isalnum() or c in "_.-" for c in name)


def _bounded(errors: list[str], value: Any, key: str, rng: Range) -> None:
    if value is None:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and rng.contains(value)
    _check(errors, ok, key, f"{rng.describe()}, got {value}")


def _validate_perplexity_set(entry: DictConfig, key: str, errors: list[str]) -> None:
    if entry.name is not None:
        _choice(errors, entry.name, f"{key}.name", DATA_KINDS)
    if entry.name in ("json", "text"):
        _check(errors, bool(entry.eval_file or entry.train_file), f"{key}.eval_file",
               f"{entry.name} names no file; set {key}.eval_file=path/to/held_out"
               f".{'jsonl' if entry.name == 'json' else 'txt'}")
    if entry.name == "hf":
        _check(errors, bool(entry.path), f"{key}.path", f"hf names no dataset; set {key}.path=<hub id or directory>")


def task_metrics(cfg: DictConfig) -> dict[str, dict[str, str] | None]:
    """{task name: {metric: better direction}} of the tasks `cfg.eval` runs; None for a harness task (its
    metrics are the harness's, known once it ran)."""
    ev = cfg.eval
    out: dict[str, dict[str, str] | None] = {}
    for kind in ("perplexity", "multiple_choice", "generate"):
        out.update({str(name): TASK_METRICS[kind] for name in ev[kind]})
    if ev.demo_items > 0:
        out["demo"] = TASK_METRICS["multiple_choice"]
    out.update({str(t): None for t in ev.lm_eval.tasks})
    return out


def metric_direction(cfg: DictConfig, metric: str) -> tuple[bool, str | None]:
    """(whether a run with this config records `metric`, the better direction when known)."""
    if metric in RUN_METRICS:
        return True, RUN_METRICS[metric]
    prefix, _, rest = metric.partition("/")
    task, _, name = rest.partition("/")
    tasks = task_metrics(cfg)
    if prefix != "tasks" or task not in tasks or not name:
        return False, None
    known = tasks[task]
    return (True, None) if known is None else (name in known, known.get(name))


def metric_errors(cfg: DictConfig) -> list[str]:
    """What is wrong with `sweep.metric` and `sweep.direction` for this config (checked for every job of a sweep
    before it launches)."""
    errors: list[str] = []
    _validate_metric(cfg, errors)
    return errors


def _validate_metric(cfg: DictConfig, errors: list[str]) -> None:
    sw = cfg.sweep
    _choice(errors, sw.direction, "sweep.direction", DIRECTIONS)
    recorded, better = metric_direction(cfg, str(sw.metric))
    if not recorded:
        offered = [*RUN_METRICS, *(f"tasks/{t}/{m}" for t, ms in task_metrics(cfg).items() for m in (ms or ["..."]))]
        errors.append(f"sweep.metric={sw.metric}: no job records it; pick one of {', '.join(offered)} (a task "
                      "metric needs its task in eval, e.g. eval=demo sweep.metric=tasks/demo/acc)")
    elif better is not None and sw.direction in DIRECTIONS and better != sw.direction:
        way = "lower" if better == "minimize" else "higher"
        errors.append(f"sweep.direction={sw.direction}: {sw.metric} is better {way}; set sweep.direction={better}")


def _validate_lr_find(cfg: DictConfig, errors: list[str], bad: typing.AbstractSet[str]) -> None:
    """lr=find: its range, and the setups it does not run in (it builds a throwaway model first)."""
    t, find = cfg.train, is_lr_find(cfg.lr)
    _check(errors, find or not t.lr_find_only, "train.lr_find_only", "stops after the lr range test, which runs "
           "with lr=find; use python -m llmexp.lr_find, or add lr=find")
    if not find:
        return
    if not bad & {"train.lr_find_start", "train.lr_find_end"}:
        _check(errors, t.lr_find_start < t.lr_find_end, "train.lr_find_end", f"must be above train.lr_find_start="
               f"{t.lr_find_start}; e.g. train.lr_find_end=10")
    for key, shown, ok, why in (
            ("deepspeed", cfg.deepspeed.name, cfg.deepspeed.stage == 0, "a DeepSpeed engine is built once per process"),
            ("fsdp", cfg.fsdp.name, cfg.fsdp.name == "none", "FSDP shards the model once per process"),
            ("batch_size", cfg.batch_size, "batch_size" in bad or parse_batch_size(cfg.batch_size) is not None,
             "batch_size=auto probes after the range test would have run")):
        _check(errors, ok, key, f"lr=find is not supported with {key}={shown} ({why}); set {key} otherwise for the "
               "range test, then run with lr=<its pick>")
