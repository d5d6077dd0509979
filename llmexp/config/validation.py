"""What a schema cannot express: value ranges, option names and cross-field rules of a composed config.

`validate(cfg)` reports every problem at once, each naming the key and the fix (exit 2; docs/explanation/
bad-input.md). A pure function of the config, so a config validates on any machine; what depends on the machine
is `llmexp.machine.environment.check_environment`'s. Each key's own rule is on its schema field (`rules.key`);
the functions below add the rules between keys. No torch here.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any
from urllib.parse import urlsplit

from omegaconf import DictConfig, ListConfig, OmegaConf

from llmexp.config.derived import MIX_ROUND, mix_quotas, model_sizes, parse_batch_size, warmup_problem, width_problems
from llmexp.config.keys import MIRRORS, entry_node, group_options, leaf_for, leaves, leaves_of, node_fields
from llmexp.config.rules import FRACTION
from llmexp.config.schema import Config, EvalConfig
from llmexp.config.security import find_values, remote_code_errors
from llmexp.config.tree import conf_dir
from llmexp.errors import UserError


class ConfigError(UserError):
    """A user's mistake in the config: the message names the key and the fix. Exit code 2."""


def _check(errors: list[str], ok: bool, key: str, message: str) -> None:
    if not ok:
        errors.append(f"{key}: {message}")


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


def configured_lr(cfg: Any) -> tuple[float, str] | None:
    """The lr the config sets, and where: `lr` itself (`config`), else the data's pretraining lr for a model
    built from scratch without adapters (`data`: `data.pretrain_lr`); None leaves it to lr=auto. A fine-tune
    never takes a data config's pretraining lr: it is ~10x what fine-tuning a pretrained model wants."""
    if (lr := parse_lr(cfg.lr)) is not None:
        return lr, "config"
    pretrain = cfg.data.pretrain_lr
    if pretrain is not None and not cfg.model.name_or_path and cfg.peft.name == "none":
        return float(pretrain), "data"
    return None


def _deleted_node_errors(node: DictConfig, cls: Any = None, prefix: str = "") -> list[str]:
    """Keys of the schema that the config lacks: deleted with `~key` (or by a config file), and config
    groups with no option chosen (`~model` leaves `model` at ???)."""
    errors = []
    for name, tp in (node_fields(Config if cls is None else cls) or {}).items():
        key = prefix + name
        if name not in node.keys():  # noqa: SIM118 (`in` is false for ???, which structure_errors reports)
            errors.append(f"{key}: is required but was deleted (by ~{key} or a config file); "
                          f"remove that deletion (python -m llmexp --cfg job shows the full config)")
        elif not prefix and OmegaConf.is_missing(node, name) and (options := group_options(name)):
            errors.append(f"{key}: no {key} is chosen (removed by ~{key}?); pick one, e.g. "
                          f"{key}={_default_option(key) or options[0]} (the options are {', '.join(options)})")
        elif (dataclasses.is_dataclass(tp) and not OmegaConf.is_missing(node, name)
              and isinstance(node[name], DictConfig)):
            errors.extend(_deleted_node_errors(node[name], tp, key + "."))
    return errors


def _default_option(group: str) -> str | None:
    """The option `llmexp/conf/config.yaml`'s defaults list picks for `group`."""
    defaults = OmegaConf.load(conf_dir() / "config.yaml").defaults
    return next((str(d[group]) for d in defaults if isinstance(d, DictConfig) and group in d), None)


def _leaf_errors(cfg: DictConfig) -> dict[str, str]:
    """key -> message for every leaf that breaks its field's rule (a path only as far as it can be judged without
    the machine: `check_environment` does the rest), `lr`, `batch_size`, the betas and free-form arguments, and
    the launcher's and sweeper's settings (`hydra.launcher.*`, `hydra.sweeper.*`) when the config has them."""
    bad = {leaf.key: problem for leaf in leaves().values()
           if (problem := leaf.rule.problem(leaf.key, OmegaConf.select(cfg, leaf.key), leaf.default))}
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
        low = is_int and value < 1
        bad["batch_size"] = (f"batch_size: must be >= 1 (or auto), got {value}; e.g. batch_size=4" if low else
                             f"batch_size: {value} does not fit in 64 bits; e.g. batch_size=4" if is_int else
                             f"batch_size={value}: must be an integer or auto; e.g. batch_size=4, or batch_size=auto "
                             "for the largest micro-batch that fits in memory")
    betas = cfg.optimizer.betas
    numbers = [b for b in betas if isinstance(b, int | float) and not isinstance(b, bool)]
    if len(betas) != 2 or len(numbers) != 2 or not all(math.isfinite(b) and FRACTION.contains(b) for b in numbers):
        shown = list(betas) if isinstance(betas, ListConfig) else betas
        bad["optimizer.betas"] = (f"optimizer.betas: must be two numbers in [0, 1), got {shown}; "
                                  "e.g. optimizer.betas=[0.9,0.999]")
    bad.update(_kwargs_errors(cfg.optimizer.kwargs, "optimizer.kwargs"))
    bad.update(_kwargs_errors(cfg.cluster.additional_parameters, "cluster.additional_parameters"))
    bad.update(_hydra_setting_errors(cfg))
    return bad


def _hydra_setting_errors(cfg: DictConfig) -> dict[str, str]:
    """`hydra.launcher.X` and `hydra.sweeper.X` given a value of their own (not the `cluster.X` / `sweep.X` they
    are mapped from, which is checked under its own name): the same rule, named as the user wrote it."""
    errors = {}
    for prefix, mirrored in MIRRORS.items():
        node = OmegaConf.select(cfg, prefix.rstrip("."))
        for name in node.keys() if isinstance(node, DictConfig) else ():
            key, twin, leaf = f"{prefix}{name}", f"{mirrored}{name}", leaf_for(f"{prefix}{name}")
            try:
                value = node[name]
            except Exception:  # an unresolvable interpolation: structure_errors names it under its own key
                continue
            if leaf is None or (twin in leaves() and value == OmegaConf.select(cfg, twin)):
                continue
            if problem := leaf.rule.problem(key, value, leaf.default):
                errors[key] = problem
    return errors


def _kwargs_errors(data: Any, key: str) -> dict[str, str]:
    """Free-form constructor arguments are passed as they are, so a float among them must be finite too."""
    non_finite = find_values(OmegaConf.to_container(data, resolve=True), key,
                             pick=lambda _, value: isinstance(value, float) and not math.isfinite(value))
    return {k: f"{k}: must be a finite number, got {value}" for k, value in non_finite}


def validate(cfg: DictConfig) -> None:
    """Check ranges and cross-field rules; raise one ConfigError that lists every problem."""
    from llmexp.config.keys import structure_errors

    # ~node, ???, unknown keys, _target_s, ${...} first: the values cannot be read or trusted until these are fixed
    errors = _deleted_node_errors(cfg) or structure_errors(cfg) or _value_errors(cfg)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def _value_errors(cfg: DictConfig) -> list[str]:
    """Each leaf by its rule, then the rules between keys: each reads only keys whose own rule holds."""
    leaf_errors = _leaf_errors(cfg)
    errors, bad = list(leaf_errors.values()), leaf_errors.keys()
    t = cfg.train
    warmup_keys = {"train.warmup_steps", "train.warmup_ratio", "train.max_steps", "scheduler.decay_ratio"}
    if not bad & warmup_keys and t.max_steps != -1 and (  # (-1: at set-up)
            problem := warmup_problem(t, cfg.scheduler, t.max_steps, f"train.max_steps={t.max_steps}")):
        errors.append(": ".join(problem))
    m, d = cfg.model, cfg.data
    _check(errors, not d.finetune_only or bool(m.name_or_path), "model.name_or_path",
           f"data={d.name} fine-tunes an earlier model; set model.name_or_path=outputs/<date>/<time>/model")
    _check(errors, d.name not in ("json", "text") or bool(d.train_file) or "data.train_file" in bad, "data.train_file",
           f"data={d.name} needs a training file; set data.train_file=path/to/train.jsonl")
    _check(errors, d.name != "hf" or bool(d.path) or bool(d.mix) or "data.path" in bad, "data.path",
           "data=hf needs a dataset: a hub id, a save_to_disk directory, or data.path=parquet with data.data_files "
           "(or several with data.mix=[{path: ..., weight: ...}, ...])")
    _validate_mix(d, errors)
    if d.streaming:
        _validate_streaming(cfg, errors, bad)
    heads = {"model.hidden_size", "model.num_attention_heads", "model.num_key_value_heads", "model.width_mult",
             "model.intermediate_size"}
    width = [] if bad & heads else width_problems(m)
    errors.extend(width)
    if m.name_or_path is None and not bad & heads and not width:
        sizes = model_sizes(m)  # what is built: the fields times model.width_mult
        _check(errors, sizes.hidden_size % sizes.num_attention_heads == 0, "model.hidden_size",
               f"{sizes.hidden_size} is not divisible by model.num_attention_heads={sizes.num_attention_heads}")
        _check(errors, sizes.num_attention_heads % sizes.num_key_value_heads == 0, "model.num_key_value_heads",
               f"{sizes.num_key_value_heads} must divide model.num_attention_heads={sizes.num_attention_heads}")
        mup = m.parametrization == "mup" and "model.mup_base_width" not in bad
        base = sizes.mup_base_sizes(m.mup_base_width) if mup else {}
        broken = ", ".join(f"{k}={v:g}" for k, v in base.items() if not v.is_integer())
        _check(errors, not broken, "model.mup_base_width",
               f"{m.mup_base_width} implies a base model with {broken} (each width / m, m = hidden_size / "
               "mup_base_width), which muP's rules assume; widen with model.width_mult, which scales every width "
               "together, or set model.mup_base_width to the hidden_size the model was tuned at")
    if m.parametrization == "mup":
        _validate_mup(cfg, errors)
    for key in ("mup_input_mult", "mup_output_mult"):  # (not `bad`: a value its rule refused is said once)
        _check(errors, m.parametrization == "mup" or m[key] == 1 or f"model.{key}" in bad, f"model.{key}",
               f"{m[key]} multiplies a mup model's {key.split('_')[1]}s; the standard model has no multiplier: set "
               f"model.parametrization=mup, or drop model.{key}")
    if m.name_or_path is None and not bad & {"data.max_length", "model.max_position_embeddings"}:
        _check(errors, d.max_length <= m.max_position_embeddings, "data.max_length",
               f"{d.max_length} exceeds model.max_position_embeddings={m.max_position_embeddings}")
    errors.extend(remote_code_errors(m))  # trust_remote_code needs a pinned commit hash
    if m.gguf_file is not None:
        _validate_gguf(cfg, errors)
    _validate_deepspeed(cfg, errors)
    _validate_peft(cfg, errors)
    _validate_sweep(cfg.sweep, errors)
    _validate_fsdp(cfg, errors)
    _validate_eval(cfg, errors, bad)
    _validate_lr_find(cfg, errors, bad)
    if (problem := tracking_uri_problem(cfg.logger.tracking_uri)) is not None:
        errors.append(problem)
    _check(errors, cfg.logger.tracking_uri is None or cfg.logger.name == "mlflow", "logger.tracking_uri",
           f"names an MLflow store, which logger={cfg.logger.name} would not use: add logger=mlflow, or drop "
           "logger.tracking_uri")  # (not repeated: it may hold credentials, refused above without a word of them)
    if "batch_size" not in bad and parse_batch_size(cfg.batch_size) is None and cfg.deepspeed.stage > 0:
        errors.append(f"batch_size=auto does not work with deepspeed={cfg.deepspeed.name}: DeepSpeed fixes the "
                      "micro-batch in its config before the model exists; set batch_size to a number "
                      "(python -m llmexp.estimate batch_size=auto shows what fits)")
    return errors


def _validate_mup(cfg: DictConfig, errors: list[str]) -> None:
    """What model.parametrization=mup cannot do: its init and per-layer lrs are set up for a model it builds."""
    m = cfg.model
    _check(errors, not m.name_or_path, "model.parametrization",
           f"mup sets up a model's init and multipliers as it builds it; model.name_or_path={m.name_or_path} is "
           "pretrained (its weights already chose): use model.parametrization=standard, or drop model.name_or_path")
    _check(errors, cfg.peft.name == "none", "model.parametrization",
           f"mup scales the lrs of a model trained whole; peft={cfg.peft.name} trains adapters on a frozen base: "
           "use model.parametrization=standard with peft, or peft=none with mup")
    # muP's readout is its own matrix, 1/width on its input and its own lr; tied to the embedding, one tensor
    # would need both rules (the mup package's MuSharedReadout), which the Granite layout does not offer.
    _check(errors, not m.tie_word_embeddings, "model.tie_word_embeddings",
           "true cannot be used with model.parametrization=mup (the output head needs its own init and lr); "
           "use model.tie_word_embeddings=false")


def _validate_fsdp(cfg: DictConfig, errors: list[str]) -> None:
    """`fsdp`: the option name, and the combinations that cannot work, each with the reason and the fix."""
    fs = cfg.fsdp
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
        problem = "must be a positive number" if math.isfinite(w) else "must be a finite number"
        _check(errors, math.isfinite(w) and w > 0, f"data.mix[{i}].weight", f"{problem}, got {w}")
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
    search = sw.name != "grid"
    _check(errors, search or sw.pruner == "none", "sweep.pruner",
           f"a pruner stops the trials of a search; use sweep=tpe (or random) with sweep.pruner={sw.pruner}, "
           "or drop sweep.pruner")
    _check(errors, not search or (not sw.zip and sw.lr_scaling == "none"), "sweep.zip",
           f"sweep.zip and sweep.lr_scaling shape a grid; sweep={sw.name} samples each key itself (drop them, or "
           "use sweep=grid)")


def _validate_gguf(cfg: DictConfig, errors: list[str]) -> None:
    """`model.gguf_file` names a file inside `model.name_or_path`, of weights that are dense once dequantised."""
    m = cfg.model
    _check(errors, bool(str(m.gguf_file).strip()), "model.gguf_file",
           "is empty; name the .gguf file inside model.name_or_path, or drop it (model.gguf_file=null)")
    _check(errors, bool(m.name_or_path), "model.gguf_file",
           f"{m.gguf_file} is a file inside a model directory or hub repo; set model.name_or_path to it")
    _check(errors, not cfg.peft.load_in_4bit, "model.gguf_file",
           f"peft={cfg.peft.name} quantises the base to 4-bit NF4, and a GGUF base is already quantised by llama.cpp "
           "(dequantising it and quantising again compounds the rounding); use peft=lora on the GGUF base")


OFFLOAD_OPTIMIZERS = ("adamw", "lion")
"""Optimizers that Accelerate maps to a DeepSpeed CPU optimizer (DeepSpeedCPUAdam / CPULion) under optimizer
offload. Accelerate would silently turn anything else into DeepSpeedCPUAdam."""


def _validate_deepspeed(cfg: Any, errors: list[str]) -> None:
    """Combinations that cannot work under DeepSpeed (the one that depends on the machine, fp16 without a GPU, is
    `environment.check_environment`'s)."""
    ds = cfg.deepspeed
    if (ds.offload_optimizer != "none" or ds.offload_param != "none") and cfg.optimizer.name.endswith("8bit"):
        errors.append(f"optimizer: {cfg.optimizer.name} keeps its state on the accelerator and cannot run under "
                      "DeepSpeed CPU offload; use optimizer=adamw with deepspeed=zero2_offload, or deepspeed=zero2")
    elif ds.offload_optimizer != "none" and cfg.optimizer.name not in OFFLOAD_OPTIMIZERS:
        errors.append(f"optimizer: {cfg.optimizer.name} has no DeepSpeed CPU implementation, and optimizer offload "
                      "needs one (Accelerate would silently swap in DeepSpeedCPUAdam); use optimizer=adamw or "
                      "optimizer=lion with deepspeed=zero2_offload, or deepspeed=zero2 without offload")
    _check(errors, ds.offload_param == "none" or ds.stage == 3, "deepspeed.offload_param",
           f"{ds.offload_param} needs ZeRO stage 3 (got stage {ds.stage}); use deepspeed=zero3 "
           "deepspeed.offload_param=cpu")
    scale = cfg.precision.init_scale
    _check(errors, ds.stage == 0 or cfg.precision.name != "fp16" or (scale >= 1 and math.log2(scale).is_integer()),
           "precision.init_scale", f"{scale}: DeepSpeed's loss scale starts at a power of two; "
           "use e.g. precision.init_scale=65536")
    _check(errors, not (ds.stage > 0 and cfg.train.on_anomaly == "rollback"), "train.on_anomaly",
           "rollback is not supported under DeepSpeed; use train.on_anomaly=skip or stop")
    _check(errors, not (ds.stage >= 3 and cfg.train.sample_prompts), "train.sample_prompts",
           "samples need whole weights on one process, and ZeRO-3 partitions them; use deepspeed=zero2, or "
           "sample from model/ after the run")


def _validate_peft(cfg: DictConfig, errors: list[str]) -> None:
    """The adapter options, and the combinations that cannot work, each with the reason."""
    pe, target = cfg.peft, cfg.peft.target_modules
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
    _check(errors, not pe.load_in_4bit or bool(cfg.model.name_or_path), "model.name_or_path",
           f"peft={pe.name} loads a pretrained model in 4 bits; set model.name_or_path=<a model directory or hub id>")
    _check(errors, cfg.deepspeed.stage == 0, "deepspeed",
           f"peft={pe.name} does not run under DeepSpeed in llmexp (adapter-only ZeRO checkpoints are not "
           "implemented, and ZeRO cannot partition 4-bit weights); adapters and their optimizer state are "
           "small, so use deepspeed=none (DDP for several GPUs)")


# ----------------------------------------------------------------------------- eval tasks, sweep.metric, lr=find

RUN_METRICS = {"eval_loss": "minimize", "eval_ppl": "minimize"}
"""The metrics every run records at each eval (`sweep.metric`'s names for them), and which way is better."""
TASK_METRICS = {"perplexity": {"loss": "minimize", "ppl": "minimize"},
                "multiple_choice": {"acc": "maximize", "acc_norm": "maximize"},
                "generate": {"exact_match": "maximize", "contains": "maximize"}}
"""What each kind of task (the `eval` group's dicts of named tasks, `eval.<kind>.<name>`) records
(`tasks/<name>/<metric>`), and which way is better; the demo task is a multiple_choice task named `demo`; harness
tasks record the harness's own metric names."""


def _validate_eval(cfg: DictConfig, errors: list[str], bad: typing.AbstractSet[str]) -> None:
    """`eval` (its option name is a `rules.Choice`): every task's name and fields, the harness's task list,
    generation only where the weights are whole, and `sweep.metric` against what the tasks record."""
    ev, lm = cfg.eval, cfg.eval.lm_eval
    names = _validate_tasks(ev, str(cfg.data.name), errors) + (["demo"] if ev.demo_items > 0 else [])
    twice = sorted({n for n in names if names.count(n) > 1})
    _check(errors, not twice, "eval", f"task names must differ (demo is the demo task's); got {', '.join(twice)} "
           "twice: rename one")
    _check(errors, "eval.lm_eval.tasks" in bad or all(_task_name_ok(str(t)) for t in lm.tasks), "eval.lm_eval.tasks",
           "must be a list of harness task names, e.g. eval.lm_eval.tasks=[arc_easy,hellaswag]")
    _check(errors, bool(lm.tasks) or ev.name != "lm_eval", "eval.lm_eval.tasks", "eval=lm_eval names no task; set "
           "eval.lm_eval.tasks=[arc_easy] (and eval.lm_eval.include_path=DIR for your own task YAMLs)")
    whole_weights = cfg.fsdp.name == "none" and cfg.deepspeed.stage < 3
    _check(errors, whole_weights or not (ev.generate or lm.tasks), "eval", "generate and lm_eval tasks run on "
           f"whole weights, and {'fsdp' if cfg.fsdp.name != 'none' else 'ZeRO-3'} shards them; use "
           "multiple_choice or perplexity tasks, or score model/ after the run")
    errors.extend(metric_errors(cfg))


def _validate_tasks(ev: DictConfig, data_name: str, errors: list[str]) -> list[str]:
    """Each `eval.<kind>.<name>` entry: its name (it becomes `tasks/<name>/...`), its fields by their rules
    (`schema.ChoiceTaskConfig`, ...), its file and stop strings; a perplexity set's source. Returns the names."""
    names: list[str] = []
    for kind in TASK_METRICS:
        for name, task in ev[kind].items():
            key = f"eval.{kind}.{name}"
            names.append(str(name))
            _check(errors, _task_name_ok(str(name)), key, "a task name must be letters, digits, _ . or - (it becomes "
                   "the metric name tasks/<name>/...); rename it")
            errors.extend(problem for leaf in leaves_of(entry_node(node_fields(EvalConfig)[kind]), f"{key}.")
                          if (problem := leaf.rule.problem(leaf.key, task[leaf.key.rsplit(".", 1)[1]], leaf.default)))
            if kind == "perplexity":  # the file or dataset its data kind reads (its files: `paths`)
                _check(errors, task.name not in ("json", "text") or bool(task.eval_file or task.train_file),
                       f"{key}.eval_file", f"{task.name} names no file; set {key}.eval_file=path/to/held_out"
                       f".{'jsonl' if task.name == 'json' else 'txt'}")
                _check(errors, task.name != "hf" or bool(task.path), f"{key}.path",
                       f"hf names no dataset; set {key}.path=<hub id or directory>")
                kind_of_set = task.name or data_name  # (null: the run's; data=stdlib would score its own eval split)
                _check(errors, kind_of_set in ("json", "text") or not (task.eval_file or task.train_file),
                       f"{key}.eval_file", f"a file is read by data=json or text, and this set's data is "
                       f"{kind_of_set}; set {key}.name=json (or text)")
                continue
            _check(errors, isinstance(task.file, str) and bool(task.file.strip()), f"{key}.file",
                   f"names no task file; set {key}.file=path/to/{name}.jsonl")
            if kind == "generate":
                _check(errors, all(isinstance(x, str) and x for x in task.stop), f"{key}.stop",
                       f"must be a list of non-empty strings, e.g. {key}.stop=['\\n']")
    return names


def _task_name_ok(name: str) -> bool:
    return bool(name) and all(c.isalnum() or c in "_.-" for c in name)


def task_metrics(cfg: DictConfig) -> dict[str, dict[str, str] | None]:
    """{task name: {metric: better direction}} of the tasks `cfg.eval` runs; None for a harness task (its
    metrics are the harness's, known once it ran)."""
    ev = cfg.eval
    out: dict[str, dict[str, str] | None] = {str(name): metrics for kind, metrics in TASK_METRICS.items()
                                             for name in ev[kind]}
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
    return (True, None) if (known := tasks[task]) is None else (name in known, known.get(name))


def metric_errors(cfg: DictConfig) -> list[str]:
    """What is wrong with `sweep.metric` for this config: a metric its runs do not record (a sweep ranking by it
    would run every trial for nothing), or `sweep.direction` against the metric's better way. Part of `validate`,
    so every job of a sweep is held to it before the sweep launches (`llmexp.sweep.check`)."""
    sw = cfg.sweep
    recorded, better = metric_direction(cfg, str(sw.metric))
    if not recorded:
        offered = [*RUN_METRICS, *(f"tasks/{t}/{m}" for t, ms in task_metrics(cfg).items() for m in (ms or ["..."]))]
        return [f"sweep.metric={sw.metric}: no job records it; pick one of {', '.join(offered)} (a task metric "
                "needs its task in eval, e.g. eval=demo sweep.metric=tasks/demo/acc)"]
    if better is not None and sw.direction in leaves()["sweep.direction"].rule.names() and better != sw.direction:
        way = "lower" if better == "minimize" else "higher"
        return [f"sweep.direction={sw.direction}: {sw.metric} is better {way}; set sweep.direction={better}"]
    return []


def _validate_lr_find(cfg: DictConfig, errors: list[str], bad: typing.AbstractSet[str]) -> None:
    """lr=find: its range, and the setups it does not run in (it sets up a throwaway run first)."""
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


TRACKING_SCHEMES = ("http", "https", "sqlite", "databricks")
"""What `logger.tracking_uri` may name: an MLflow server, a SQLite store, or Databricks."""
MAX_URI_LEN = 2048
_URI_EXAMPLE = "e.g. logger.tracking_uri=http://127.0.0.1:5000, or leave it null for a store in the run directory"


def tracking_uri_problem(uri: Any) -> str | None:
    """Why `logger.tracking_uri` cannot work (the message names the fix), or None; null is the local store."""
    if uri is None:
        return None
    if not isinstance(uri, str) or not uri.strip() or len(uri) > MAX_URI_LEN or not uri.isprintable() or " " in uri:
        shown = uri if not isinstance(uri, str) or len(uri) <= 80 else uri[:77] + "..."
        return (f"logger.tracking_uri: must be a URI without spaces of at most {MAX_URI_LEN} characters, got "
                f"{shown!r}; {_URI_EXAMPLE}")
    try:
        parts = urlsplit(uri)
        _ = parts.port  # raises on a port that is not a number in 0..65535
    except ValueError as err:
        return f"logger.tracking_uri={uri}: not a URI ({err}); {_URI_EXAMPLE}"
    if parts.username is not None or parts.password is not None:  # before any message repeats the URI
        return ("logger.tracking_uri: holds credentials (user:password@), which would reach logs and run files; put "
                "them in MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN and drop them "
                "from the URI")
    if uri == "databricks":  # the workspace of the default Databricks profile
        return None
    scheme = parts.scheme.lower()
    if scheme == "file" or not scheme:  # a path that names a database file already: that file, else one in it
        db = parts.path if parts.path.endswith((".db", ".sqlite")) else f"{parts.path or '/path/to'}/mlflow.db"
        return (f"logger.tracking_uri={uri}: MLflow 3 refuses file stores (maintenance mode); use "
                f"sqlite:///{db}, or a server: {_URI_EXAMPLE}")
    if scheme not in TRACKING_SCHEMES:
        return (f"logger.tracking_uri={uri}: {scheme}:// is not one of {', '.join(TRACKING_SCHEMES)}; to keep "
                "runs in a database, run an MLflow server on it (mlflow server --backend-store-uri ...) and point "
                f"at the server: {_URI_EXAMPLE}")
    if scheme in ("http", "https") and not parts.hostname:
        return f"logger.tracking_uri={uri}: names no host; {_URI_EXAMPLE}"
    if scheme == "sqlite" and (not uri.startswith("sqlite:///") or uri in ("sqlite:///", "sqlite:///:memory:")):
        return (f"logger.tracking_uri={uri}: a SQLite store is sqlite:/// followed by a file path, e.g. "
                "sqlite:////abs/path/mlflow.db (nothing in memory survives the run)")
    return None
