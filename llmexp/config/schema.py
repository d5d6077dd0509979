"""Typed configuration: one dataclass per config group, registered in Hydra's ConfigStore.

The primary config (`llmexp/conf/config.yaml`) extends `Config`, so every group option that Hydra merges into
`model`, `data`, ... is checked against these schemas at compose time: a typo'd key or a wrong type fails before
anything is imported or loaded. Each key is described once, here: `key(default, rule, doc)` (`llmexp.config.rules`)
puts its rule and doc on the field, where `validation`, `--help` and the docs reference (`keys.reference`) read
them. This module imports no torch: it sits on the `--help` path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, open_dict

from llmexp.config.rules import (
    FLAG,
    FRACTION,
    LABEL,
    OPTIONAL,
    POSITIVE,
    SEED_MAX,
    Choice,
    PathRule,
    Range,
    Special,
    Text,
    TextList,
    key,
)
from llmexp.config.tree import conf_dir, register_resolvers

_SHORT_LABEL = Text(nullable=False, max_len=200)


@dataclass
class ModelConfig:
    """The model: built from these fields with `from_config`, or loaded from `name_or_path`."""

    name: str = key("tiny", LABEL, "Label for reports and run names.")
    name_or_path: str | None = key(None, PathRule("model"), "A local directory or hub id to load with "
                                   "`from_pretrained`; null builds from the fields below.")
    gguf_file: str | None = key(None, Special(
        "a GGUF file inside model.name_or_path that transformers can load, without a 4-bit base",
        ("''", "x.gguf", "'  '")), "A GGUF file (llama.cpp's format) in `name_or_path`, loaded instead of its "
        "safetensors: transformers dequantises it to the run's dtype once per machine (`pip install "
        "'llmexp[gguf]'`); `model/` is then plain safetensors.")
    revision: str | None = key(None, OPTIONAL, "Hub revision (commit hash) to pin; required when "
                               "`trust_remote_code` is true.")
    trust_remote_code: bool = key(False, FLAG, "Run modelling code shipped with a hub model. Off unless you trust "
                                  "its author.")
    hidden_size: int = key(256, Range(low=1), "Width of the residual stream.")
    num_hidden_layers: int = key(4, Range(low=1), "Number of transformer blocks.")
    num_attention_heads: int = key(4, Range(low=1), "Attention heads per block.")
    num_key_value_heads: int = key(4, Range(low=1), "KV heads (grouped-query attention when fewer than the "
                                   "attention heads).")
    intermediate_size: int = key(688, Range(low=1), "Width of the SwiGLU MLP.")
    vocab_size: int = key(8192, Range(low=1), "Vocabulary size; the stdlib tokenizer is trained to this size.")
    max_position_embeddings: int = key(256, Range(low=1), "Context length the model is built for.")
    rope_theta: float = key(10000.0, POSITIVE, "RoPE base frequency.")
    tie_word_embeddings: bool = key(False, FLAG, "Share the input embedding with the output head.")
    attention_dropout: float = key(0.0, FRACTION, "Dropout on attention probabilities (a remedy for overfitting).")
    gradient_checkpointing: bool = key(False, FLAG, "Recompute activations in backward to save memory.")
    width_mult: float = key(1.0, POSITIVE, "Scale hidden_size, intermediate_size, num_attention_heads and "
                            "num_key_value_heads by this factor, the head size fixed (a sweep axis: "
                            "model.width_mult=1,2,4); each scaled size must be a whole number. Models built from "
                            "the fields only.")
    parametrization: str = key("standard", Choice(("standard", "mup")), "standard, or mup (maximal update "
                               "parametrization, Tensor Programs V): init, lr and logits scaled with the width so a "
                               "config tuned at `mup_base_width` carries over to wider models. Models built from "
                               "the fields only, without adapters.")
    mup_base_width: int = key(256, Range(low=1), "mup: the hidden_size at which mup equals standard (the width "
                              "the hyperparameters were tuned at).")
    mup_input_mult: float = key(1.0, POSITIVE, "mup: alpha_input, the embeddings' output multiplier, tuned at the "
                                "base width with the lr and carried to every width (1: the standard model there).")
    mup_output_mult: float = key(1.0, POSITIVE, "mup: alpha_output, the logits' multiplier (x it / m), tuned and "
                                 "carried over as mup_input_mult is.")


@dataclass
class HfSourceConfig:
    """How `data=hf` reads one dataset: the fields `data` and each `data.mix` entry share."""

    data_files: Any = key(None, PathRule("hf_files"), "hf: the file, glob or list of files a file builder reads.")
    config_name: str | None = key(None, OPTIONAL, "hf: the dataset's configuration (what "
                                  "`datasets.load_dataset` calls `name`).")
    split: str = key("train", LABEL, "hf: the split to train on.")
    eval_split: str | None = key(None, OPTIONAL, "hf: the split to evaluate on; null holds out "
                                 "`data.eval_fraction` of the training rows.")
    text_field: str | None = key(None, OPTIONAL, "hf: the column of plain text (null: found by name: text, "
                                 "prompt/completion, messages, Alpaca's).")
    prompt_field: str | None = key(None, OPTIONAL, "hf: the prompt column of prompt/completion data.")
    completion_field: str | None = key(None, OPTIONAL, "hf: the completion column of prompt/completion data.")
    messages_field: str | None = key(None, OPTIONAL, "hf: the column of chat messages (a list of {role, content}).")


@dataclass
class MixSourceConfig(HfSourceConfig):
    """One source of `data.mix`: a dataset as `data=hf` reads it, and its share of the training examples."""

    path: str = key(MISSING, PathRule("hf_source"), "A hub id, a `save_to_disk` directory, or a file builder "
                    "(parquet, arrow, json, csv, text).")
    weight: float = key(1.0, POSITIVE, "This source's share of the training examples, relative to the others' weights.")


@dataclass
class DataConfig(HfSourceConfig):
    """Where tokens come from and how they are cut into training examples (the `data=hf` fields inherited)."""

    name: str = key("stdlib", Choice(group="data"), "Corpus kind: stdlib, stdlib_sft, json, text or hf (the "
                    "`datasets` library).")
    train_file: str | None = key(None, PathRule("data_file"), "json/text: training file (JSON list or JSONL for "
                                 "json; a file, directory or glob for text).")
    eval_file: str | None = key(None, PathRule("data_file"), "json/text: evaluation file; null holds out "
                                "`eval_fraction` of the training records.")
    max_length: int = key(256, Range(low=2), "Tokens per example (the block size when packing).")
    packing: bool = key(True, FLAG, "Pack examples into full blocks; SFT data is padded per example unless this "
                        "is true.")
    eval_fraction: float = key(0.05, Range(low=0, high=1, low_open=True, high_open=True), "Share of files "
                               "(stdlib) or records held out for eval when there is no eval file.")
    tokenizer: str | None = key(None, PathRule("tokenizer"), "A tokenizer directory; null uses the model's, or "
                                "trains a byte-level BPE on the corpus.")
    cache_dir: str = key("${oc.env:LLMEXP_CACHE,${oc.env:HOME}/.cache/llmexp}", PathRule("dir_out"),
                         "Where tokenizers and token arrays are cached, keyed by a content hash.")
    num_proc: int = key(2, Range(low=1), "Processes for Python-side preparation (stdlib_sft parsing); "
                        "tokenising uses the tokenizers thread pool.")
    max_examples: int | None = key(None, Range(low=1, note="(or null for all)"), "Use at most this many "
                                   "training records (stdlib_sft and quick experiments).")
    finetune_only: bool = key(False, FLAG, "Refuse to start without model.name_or_path: this data fine-tunes an "
                              "earlier run's model.")
    pretrain_lr: float | None = key(None, Range(low=0, low_open=True, note="(or null)"), "The lr lr=auto takes "
                                    "for a model trained from scratch on this data (stdlib: 6e-4, measured for the "
                                    "default run); a fine-tune (model.name_or_path) or adapters keep lr=auto's own "
                                    "rule, and an explicit lr wins.")
    path: str | None = key(None, PathRule("hf_source"), "hf: a hub id, a `save_to_disk` directory, or a file "
                           "builder (parquet, arrow, json, csv, text).")
    mix: list[MixSourceConfig] = key([], Special(
        "data=hf only: each source a path and a positive weight",
        ("[{weight: 1.0}]", "[{path: x, weight: 0.0}]", "[{path: x, weight: inf}]", "[{path: x, weight: -1.0}]")),
        "hf: several datasets sampled by weight instead of `data.path` (each entry: path, weight, and any of "
        "data_files, config_name, split, eval_split, *_field). Every 1,000 training examples hold each source's "
        "share to within one example, in an order that is a pure function of (seed, step).")
    streaming: bool = key(False, FLAG, "hf: read the train split as training goes (`datasets` streaming) instead "
                          "of tokenising it into the cache first, for corpora larger than memory or the disk cache; "
                          "needs train.max_steps and a tokenizer.")
    shuffle_window: int = key(10000, Range(low=1), "streaming: records are shuffled within consecutive windows of "
                              "this many, by (seed, epoch, window), so resume is exact; larger windows mix more and "
                              "replay more on resume.")
    stream_eval_rows: int = key(1000, Range(low=1), "streaming without data.eval_split: the first this-many rows "
                                "of the split are the eval set; training skips them.")


@dataclass
class PrecisionConfig:
    """Numeric precision of the forward and backward passes; master weights stay in fp32."""

    name: str = key("auto", Choice(group="precision"), "bf16, fp16 (with dynamic loss scaling), fp32, or auto "
                    "(bf16 where fast, else fp32).")
    init_scale: float = key(65536.0, POSITIVE, "fp16: the first loss scale.")
    growth_interval: int = key(2000, Range(low=1), "fp16: steps without overflow before the loss scale doubles.")
    tf32: bool = key(True, FLAG, "CUDA: fp32 matmuls and convolutions in TF32 (Ampere and later; several times the "
                     "fp32 rate, a 10-bit mantissa), as nanoGPT and torchtitan run them; false for bitwise "
                     "comparisons with plain fp32. A CPU is untouched.")


@dataclass
class OptimizerConfig:
    """The optimizer; `_target_` must be on the allow-list in `llmexp.config.security`."""

    _target_: str = key("torch.optim.AdamW", Special(
        "an allow-listed optimizer class (llmexp.config.security.OPTIMIZER_TARGETS)",
        ("builtins.open", "os.system", "torch.optim.__builtins__", "")),
        "Optimizer class; only allow-listed classes are instantiated.")
    name: str = key("adamw", Choice(group="optimizer"), "adamw, adamw8bit, paged_adamw8bit, lion, lion8bit or sgd.")
    betas: list[float] = key([0.9, 0.999], Special(
        "two numbers in [0, 1)", ("[0.9]", "[0.9,1.0]", "[0.9,inf]", "[-0.1,0.9]", "[]", "[0.9,0.99,0.999]")),
        "Adam/Lion betas.")
    eps: float = key(1e-8, Range(low=0), "Adam epsilon.")
    momentum: float = key(0.0, FRACTION, "SGD momentum.")
    decay_norms_and_biases: bool = key(False, FLAG, "Also apply weight decay to 1-D params (norms, biases) and "
                                       "embeddings.")
    kwargs: dict[str, Any] = key({}, Special("passed to the constructor as they are; floats finite",
                                             ("{foreach_eps: inf}", "{x: nan}")),
                                 "Extra constructor arguments passed as they are.")


@dataclass
class SchedulerConfig:
    """The learning-rate schedule, a pure function of the step (see `llmexp.train.schedule`)."""

    name: str = key("cosine", Choice(group="scheduler"), "cosine, linear, constant or wsd (warmup-stable-decay).")
    min_lr_ratio: float = key(0.1, Range(low=0, high=1), "The lr at the end of decay, as a fraction of the peak lr.")
    decay_ratio: float = key(0.2, Range(low=0, high=1, low_open=True), "wsd: the fraction of steps spent in the "
                             "final decay.")


@dataclass
class SlurmJobConfig:
    """One SLURM job's resources and requeue settings: llmexp's `cluster.*` keys and the `llmexp_slurm`
    launcher's `hydra.launcher.*` (hydra_plugins/llmexp_launcher) both hold these fields."""

    partition: str | None = key(None, OPTIONAL, "slurm: partition.")
    nodes: int = key(1, Range(low=1), "slurm: nodes per job.")
    gpus_per_node: int = key(0, Range(low=0), "slurm: GPUs per node.")
    tasks_per_node: int = key(1, Range(low=1), "slurm: tasks (trainer processes) per node.")
    cpus_per_task: int = key(1, Range(low=1), "slurm: CPUs per task.")
    mem_gb: int | None = key(None, Range(low=1, note="(or null for the partition's default)"), "slurm: memory per "
                             "node in GB.")
    timeout_min: int = key(60, Range(low=1), "slurm: wall-time limit per job in minutes.")
    account: str | None = key(None, OPTIONAL, "slurm: account to charge.")
    qos: str | None = key(None, OPTIONAL, "slurm: quality of service.")
    constraint: str | None = key(None, OPTIONAL, "slurm: node feature constraint.")
    signal_delay_s: int = key(120, Range(low=0), "slurm: seconds before the time limit at which the job is "
                              "signalled to checkpoint.")
    max_num_timeout: int = key(3, Range(low=0), "slurm: requeues allowed after timeouts or preemptions.")
    array_parallelism: int = key(256, Range(low=1), "slurm: jobs of the array running at once.")
    additional_parameters: dict[str, Any] = key({}, Special("sbatch options; floats finite", ("{x: inf}",)),
                                                "slurm: extra sbatch parameters.")
    setup: list[str] = key([], TextList(LABEL), "slurm: shell lines the job script runs before the job, e.g. "
                           "`module load cuda/12.4` or `source ~/venv/bin/activate`. They are written into the "
                           "sbatch script: keep secrets in the environment.")


@dataclass
class ClusterConfig(SlurmJobConfig):
    """Where sweep jobs run: `local` processes or SLURM through submitit.

    llmexp's short spelling of the launcher's settings: `llmexp/conf/hydra/launcher/cluster_*.yaml` maps
    each key onto `hydra.launcher.*`, where the launchers (`hydra_plugins.llmexp_launcher`) read them."""

    name: str = key("local", Choice(group="cluster"), "local or slurm.")
    max_parallel: int = key(1, Range(low=1), "local, CPU: jobs run at once (on GPUs: one per GPU times "
                            "`jobs_per_gpu`).")
    jobs_per_gpu: int = key(1, Range(low=1), "local, GPU: jobs that share one GPU.")
    wait: bool = key(True, FLAG, "Wait for the jobs and write the sweep report; false returns right after submission.")


@dataclass
class DeepSpeedConfig:
    """DeepSpeed ZeRO through Accelerate's plugin; micro-batch, accumulation, clipping and
    precision are derived from the rest of the config."""

    name: str = key("none", LABEL, "none, zero2, zero2_offload or zero3.")
    stage: int = key(0, Range(low=0, high=3), "ZeRO stage (0 = DeepSpeed off).")
    offload_optimizer: str = key("none", Choice(("none", "cpu")), "none or cpu: keep optimizer state (and its "
                                 "step) on the CPU.")
    offload_param: str = key("none", Choice(("none", "cpu")), "none or cpu: ZeRO-3 parameter offload.")


@dataclass
class FsdpConfig:
    """PyTorch FSDP2 (torch's `fully_shard`; Accelerate's plugin is off on CPU and one process, see
    `llmexp.train.engines.fsdp`): each decoder layer is one unit; its mixed precision follows `precision` and its
    activation checkpointing `model.gradient_checkpointing`. Checkpoints go through DCP and reshard on load."""

    name: str = key("none", Choice(group="fsdp"), "none (DDP when several processes run), full_shard "
                    "(parameters, gradients and optimizer state sharded: ZeRO-3-like), shard_grad_op (parameters "
                    "kept whole after the forward: ZeRO-2-like) or hybrid_shard (full_shard inside a node, "
                    "replicated across nodes).")
    cpu_offload: bool = key(False, FLAG, "Keep sharded parameters, gradients and optimizer state on the CPU "
                            "between uses.")


@dataclass
class GridSweepConfig:
    """The grid's options (`sweep=grid`); also the `llmexp_grid` Hydra sweeper's, which `sweep.*` maps onto."""

    zip: list[str] = key([], TextList(_SHORT_LABEL), "Keys swept together instead of as a product, e.g. "
                         "[lr,batch_size]: the i-th values pair up.")
    lr_scaling: str = key("none", Choice(("none", "sqrt", "linear")), "none, sqrt or linear: scale each job's lr "
                          "by (batch_size / base_batch_size)**(1/2 or 1).")
    base_batch_size: int | None = key(None, Range(low=1, note="(or null: the smallest batch_size swept)"),
                                      "With lr_scaling: the batch size the given lr is for (null: the smallest "
                                      "batch_size swept).")


@dataclass
class SearchSweepConfig:
    """A search's options (`sweep=random|tpe`); also the `llmexp_search` Hydra sweeper's."""

    n_trials: int = key(12, Range(low=1), "Trials in all (those of an earlier, interrupted launch of the same "
                        "sweep count).")
    parallel: int = key(1, Range(low=1), "Trials at once (GPUs, SLURM array slots or CPU slots).")
    seed: int = key(0, Range(low=0, high=SEED_MAX), "The sampler's seed.")
    pruner: str = key("none", Choice(("none", "asha", "hyperband", "median")), "asha, hyperband, median or none; "
                      "a trial's eval losses are its intermediate values.")


@dataclass
class SweepConfig(SearchSweepConfig, GridSweepConfig):
    """How `--multirun` explores: Hydra's grid, or an optuna search with pruning from live eval losses."""

    name: str = key("grid", Choice(group="sweep"), "grid (every combination, as Hydra's basic sweeper), random or "
                    "tpe (optuna samplers).")
    metric: str = key("eval_loss", Special(
        "eval_loss, eval_ppl, or tasks/<name>/<metric> of a task this config's eval runs (a sweep checks every "
        "job's before it launches)", ("accuracy", "tasks/demo/acc", "", "tasks//acc", "tasks/demo", "eval_loss/x")),
        "What the search, its pruner, the grid's recommendation and the sweep report rank by: eval_loss, eval_ppl "
        "or a task metric `tasks/<name>/<metric>` (e.g. tasks/demo/acc) that the jobs' `eval` records.")
    direction: str = key("minimize", Choice(("minimize", "maximize")), "minimize (losses) or maximize (accuracies).")


@dataclass
class LauncherSettings:
    """The `hydra.launcher.*` settings of llmexp's launchers (hydra_plugins/llmexp_launcher) that no `cluster.*`
    key spells; every other `hydra.launcher.X` is `cluster.X` under the launcher's name."""

    _target_: str = key("hydra_plugins.llmexp_launcher.llmexp_launcher.LocalLauncher", Special(
        "llmexp's launchers or Hydra's basic one (security.LAUNCHER_TARGETS)", ("os.system",)),
        "The launcher class; cluster= picks it.")
    submitit_folder: str = key("${hydra.sweep.dir}/.submitit/%j", Special("inside the sweep directory",
                                                                          ("/tmp/elsewhere/%j",)),
                               "slurm: where submitit keeps each job's script, pickles and logs.")


@dataclass
class SweeperSettings:
    """The `hydra.sweeper.*` settings of llmexp's sweepers (hydra_plugins/llmexp_sweeper) that no `sweep.*` key
    spells; every other `hydra.sweeper.X` is `sweep.X` under the sweeper's name."""

    _target_: str = key("hydra_plugins.llmexp_sweeper.llmexp_sweeper.GridSweeper", Special(
        "llmexp's sweepers or Hydra's basic one (security.SWEEPER_TARGETS)", ("os.system",)),
        "The sweeper class; sweep= picks it.")
    sampler: str = key("tpe", Choice(("random", "tpe")), "search: random or tpe (sweep.name).")
    max_batch_size: int | None = key(None, Range(low=1, note="(or null: every job at once)"), "grid: jobs handed "
                                     "to the launcher at once (null: all).")
    params: dict[str, str] | None = key(None, Special("each entry a swept override, checked like the command "
                                                      "line's", ("{lr: 'interval(1,0)'}",), sweep_only=True),
                                        "Swept keys (or search-space entries) given in the config instead of the "
                                        "command line, as Hydra's basic sweeper takes them.")


@dataclass
class LoggerConfig:
    """Metric sinks besides `metrics.jsonl` and the console, which are always on."""

    name: str = key("jsonl", Choice(group="logger"), "jsonl, wandb, tensorboard or mlflow.")
    project: str = key("llmexp", Text(nullable=False, max_len=128, forbid="/\\#?%:", public=True),
                       "wandb: project.")  # (max_len and forbid: what wandb refuses)
    entity: str | None = key(None, Text(public=True), "wandb: entity (team).")
    mode: str = key("auto", Choice(("auto", "online", "offline", "disabled")), "wandb: online, offline, or auto "
                    "(offline without WANDB_API_KEY).")
    init_timeout_s: float = key(10.0, POSITIVE, "wandb, mlflow: seconds a start may take to reach the server; past "
                                "it the run logs locally instead (wandb offline, mlflow to the local store; one "
                                "warning).")
    tags: list[str] = key([], TextList(Text(nullable=False, max_len=64, public=True)),
                          "wandb: tags.")  # (wandb refuses longer)
    tracking_uri: str | None = key(None, Special(
        "null, or an MLflow server, SQLite or Databricks URI without credentials",
        ("file:///tmp/mlruns", "ftp://x", "http://u:p@h:5000")),
        "mlflow: the tracking server (http://host:5000, https://..., databricks) or a SQLite store "
        "(sqlite:///path/mlflow.db); null: a SQLite store in the run directory, or the sweep directory for a sweep's "
        "jobs, which needs no server. Credentials go in MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME/PASSWORD, "
        "never in the URI.")
    experiment: str = key("llmexp", Text(nullable=False, max_len=256, public=True),  # MLflow SQL: VARCHAR(256)
                          "mlflow: the experiment the run (or the sweep's parent run) is logged to; created when "
                          "missing.")
    log_model: bool = key(False, FLAG, "mlflow: also upload the final `model/` directory as the run's `model` "
                          "artifact (may be large).")


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning through the peft library: train low-rank adapters, freeze the base."""

    name: str = key("none", Choice(group="peft"), "none (every weight trains), lora, or qlora (LoRA on a 4-bit NF4 "
                    "base through bitsandbytes).")
    r: int = key(16, Range(low=1), "LoRA rank: the adapters' inner width.")
    lora_alpha: float = key(32.0, POSITIVE, "LoRA scaling numerator: the update is scaled by lora_alpha / r.")
    lora_dropout: float = key(0.05, FRACTION, "Dropout on the adapters' input.")
    target_modules: Any = key("all-linear", Special("all-linear or a list of module names",
                                                    ("[]", "5", "['']", "some-linear")),
                              "Which layers get adapters: all-linear (every linear layer of the decoder, per "
                              "architecture, never the output head), or a list of module names such as [q_proj, "
                              "v_proj].")
    load_in_4bit: bool = key(False, FLAG, "Load the base weights in 4 bits (qlora sets it).")
    bnb_4bit_quant_type: str = key("nf4", Choice(("nf4", "fp4")), "4-bit data type: nf4 (QLoRA's NormalFloat) or fp4.")
    bnb_4bit_use_double_quant: bool = key(True, FLAG, "Quantise the quantisation constants too (about 0.37 bits "
                                          "per weight saved).")


@dataclass
class PerplexitySetConfig(HfSourceConfig):
    """One extra held-out set (`eval.perplexity.<name>`): the run's `data` with these fields replaced (null keeps
    the run's), scored on its eval split as the eval loss is. Any `data=` source: a json/text file, a `data=hf`
    dataset, e.g. one per source of a `data.mix`."""

    name: str | None = key(None, Choice(group="data"), "Corpus kind: stdlib, stdlib_sft, json, text or hf; null: "
                           "the run's `data.name`.")
    train_file: str | None = key(None, PathRule("data_file"), "json/text: the file to split (null with eval_file: "
                                 "the whole eval_file is the set).")
    eval_file: str | None = key(None, PathRule("data_file"), "json/text: a file scored whole.")
    path: str | None = key(None, PathRule("hf_source"), "hf: a hub id, a `save_to_disk` directory, or a file "
                           "builder (parquet, arrow, json, csv, text).")


_TASK_FILE = "an existing, non-empty JSONL file"
_MAX_ITEMS = Range(low=1, note="(or null for all)")


@dataclass
class ChoiceTaskConfig:
    """A multiple-choice task (`eval.multiple_choice.<name>`), scored by the log-likelihood of each choice."""

    file: str | None = key(None, Special(_TASK_FILE), 'A JSONL file of {"context": str, "choices": [str, ...], '
                           '"answer": index}.')
    delimiter: str = key(" ", Special("any text"), "Put between the context and each choice "
                         "(lm-evaluation-harness's `target_delimiter`).")
    max_items: int | None = key(None, _MAX_ITEMS, "Score the first this-many items; null: all.")


@dataclass
class GenerateTaskConfig:
    """A generation task (`eval.generate.<name>`): greedy continuations scored by exact match and containment."""

    file: str | None = key(None, Special(_TASK_FILE), 'A JSONL file of {"prompt": str, "target": str}.')
    max_new_tokens: int = key(32, Range(low=1, high=4096), "Tokens generated per prompt.")
    stop: list[str] = key(["\n"], Special("a list of non-empty strings"), "The completion is cut at the first of "
                          "these strings before it is compared.")
    examples: int = key(3, Range(low=0, high=1000), "Items whose prompt, completion and target are kept in each "
                        "record (for the report).")
    max_items: int | None = key(None, _MAX_ITEMS, "Score the first this-many items; null: all.")


@dataclass
class LmEvalConfig:
    """lm-evaluation-harness tasks (`pip install llmexp[eval]`), run on the in-memory model."""

    tasks: list[str] = key([], TextList(_SHORT_LABEL), "Harness task names, e.g. [arc_easy, hellaswag], or the "
                           "names of tasks in `include_path`.")
    include_path: str | None = key(None, PathRule("task_dir"), "A directory of task YAMLs (offline: `dataset_path: "
                                   "json` with `dataset_kwargs.data_files`).")
    trust_code: bool = key(False, FLAG, "Let the task YAMLs of `include_path` run Python: `!function` tags "
                           "(theirs and their `include:`s'), Jinja templates that reach past the document's fields. "
                           "Off: such a folder is refused before the run starts.")
    include_defaults: bool = key(True, FLAG, "Also index the harness's built-in tasks (~15,000; ~25 s at the start "
                                 "of a run).")
    limit: int | None = key(None, Range(low=1, note="(or null for every document)"), "Score at most this many "
                            "documents per task; null: all.")
    num_fewshot: int | None = key(None, Range(low=0, high=1000, note="(or null: each task's own)"), "Few-shot "
                                  "examples; null: each task's own setting.")
    batch_size: int = key(8, Range(low=1, high=4096), "Requests per forward.")


_TASKS = "each entry's name (letters, digits, _ . -), file and fields by their rules"


@dataclass
class EvalConfig:
    """What each eval measures besides the held-out loss: extra held-out sets and downstream tasks, all run at
    every `train.eval_steps` and at the end. Metrics are `tasks/<name>/<metric>`; `sweep.metric` may name one."""

    name: str = key("loss", Choice(group="eval"), "loss (the held-out loss only), demo, perplexity, "
                    "multiple_choice, generate or lm_eval.")
    perplexity: dict[str, PerplexitySetConfig] = key({}, Special(
        f"{_TASKS}; a data kind and the source it reads",
        ("{p: {name: jsonl}}", "{p: {name: json}}", "{p: {name: hf}}", "{a+b: {name: stdlib}}")),
        "Extra held-out sets by name: loss and ppl of each.")
    multiple_choice: dict[str, ChoiceTaskConfig] = key({}, Special(_TASKS, (
        "{mc: {max_items: 2}}", "{mc: {file: ''}}", "{mc: {file: /nonexistent/mc.jsonl}}",
        "{mc: {file: x.jsonl, max_items: 0}}", "{a+b: {file: x.jsonl}}")),
        "Multiple-choice tasks by name: acc and length-normalised acc_norm.")
    generate: dict[str, GenerateTaskConfig] = key({}, Special(_TASKS, (
        "{qa: {max_new_tokens: 5}}", "{qa: {file: /nonexistent/qa.jsonl}}", "{qa: {file: x.jsonl, max_new_tokens: 0}}",
        "{qa: {file: x.jsonl, examples: -1}}", "{qa: {file: x.jsonl, stop: ['']}}")),
        "Generation tasks by name: exact_match and contains.")
    lm_eval: LmEvalConfig = field(default_factory=LmEvalConfig)
    demo_items: int = key(0, Range(low=0, high=100_000, note="(0: no demo task)"), "Items of the demo task "
                          "(\"which line comes next?\", from the held-out data); 0: no demo task.")
    batch_size: int = key(16, Range(low=1, high=4096), "Sequences per forward when scoring choices or generating.")


@dataclass
class TrainConfig:
    """The training loop. Names follow HF `TrainingArguments` where it has the same knob."""

    max_steps: int = key(250, Range(low=1, also=(-1,), note="(-1 trains for train.num_train_epochs)"),
                         "Optimizer steps; -1 trains for `num_train_epochs` instead.")
    num_train_epochs: float = key(1.0, POSITIVE, "Epochs over the training set, used when `max_steps` is -1.")
    gradient_accumulation_steps: int = key(1, Range(low=1), "Micro-batches per optimizer step, per process.")
    global_batch_size: int | None = key(None, Range(low=1, note="(or null)"), "Examples per optimizer step across "
                                        "all processes; derives the accumulation steps.")
    max_grad_norm: float = key(1.0, Range(low=0, note="(0 disables)"), "Clip the global grad norm to this after "
                               "backward, before the step; 0 disables.")
    warmup_ratio: float = key(0.05, FRACTION, "Warmup as a fraction of `max_steps`.")
    warmup_steps: int | None = key(None, Range(low=0, note="(or null to use train.warmup_ratio)"), "Warmup in "
                                   "steps; overrides `warmup_ratio`.")
    weight_decay: float = key(0.01, Range(low=0), "Decoupled weight decay (matrices only, unless the optimizer says "
                              "otherwise).")
    logging_steps: int = key(10, Range(low=1), "Steps between train metric lines.")
    eval_steps: int = key(100, Range(low=1), "Steps between evals (also at the end, and at step 0 when it is at "
                          "most `max_steps`).")
    eval_batches: int = key(16, Range(low=1, also=(-1,), note="(-1 evaluates the whole eval set)"), "Batches of "
                            "`batch_size` per eval; -1 evaluates the whole eval set.")
    sample_prompts: list[str] = key([], TextList(Text(nullable=False, max_len=10_000, one_line=False)), "Prompts "
                                    "the model continues while it trains (metrics.jsonl, console, wandb, report.md); "
                                    "none: no samples.")
    sample_steps: int = key(0, Range(low=0, note="(0: only at the end)"), "Steps between samples (also at step 0 and "
                            "at the end); 0 samples only at the end.")
    sample_max_new_tokens: int = key(32, Range(low=1, high=4096), "Tokens generated per prompt.")
    sample_temperature: float = key(0.0, Range(low=0, note="(0 decodes greedily)"), "0 decodes greedily; above 0 "
                                    "samples at this temperature.")
    sample_seed: int = key(0, Range(low=0, high=SEED_MAX), "Seed of sampling, on a generator of its own: "
                           "training's random state is never touched.")
    save_steps: int = key(100, Range(low=0, note="(0: only at the end)"), "Steps between checkpoints; 0 saves only "
                          "at the end and on preemption.")
    save_total_limit: int = key(2, Range(low=1), "Checkpoints kept (the best one is kept in addition).")
    save_final: bool = key(True, FLAG, "Write the final checkpoint and `model/` when the run ends; false writes "
                           "neither (benchmarks: a 1B model's are ~17 GB).")
    resume: str = key("auto", PathRule("checkpoint"), "auto (newest complete checkpoint in the run directory), "
                      "never, or a checkpoint path.")
    resume_data_mismatch: str = key("error", Choice(("error", "warn")), "A resume whose data fingerprint (corpus, "
                                    "tokenizer, data settings) differs from the checkpoint's: error (exit 2, naming "
                                    "both) or warn (resume on the new data).")
    compile: bool = key(False, FLAG, "torch.compile the model; compile time is reported apart from step time.")
    cpu_matmul: str = key("auto", Choice(("auto", "torch")), "fp32 eager training on a CPU: auto measures torch's "
                          "matmul (MKL on x86) against oneDNN's at start and takes oneDNN where it is faster with "
                          "equal results (AMD CPUs: ~2x; `llmexp.model.cpu_matmul`); torch keeps torch's.")
    on_anomaly: str = key("skip", Choice(("stop", "skip", "rollback")), "On a non-finite loss or grad norm: stop, "
                          "skip the step, or rollback to a checkpoint.")
    max_consecutive_anomalies: int = key(5, Range(low=1), "skip: anomalous steps in a row before the run is "
                                         "declared diverged.")
    max_rollbacks: int = key(3, Range(low=0), "rollback: rollbacks before the run is declared diverged.")
    rollback_lr_factor: float = key(0.5, Range(low=0, high=1, low_open=True), "rollback: multiply the lr by this "
                                    "after each rollback.")
    early_stopping_patience: int = key(0, Range(low=0, note="(0 disables)"), "Evals without improvement before "
                                       "stopping early; 0 disables.")
    peak_tflops: float | None = key(None, Range(low=0, low_open=True, note="(or null to measure it)"), "Peak TFLOP/s "
                                    "for MFU; null measures a bf16 (or fp32) matmul ceiling at start.")
    seed_data: int | None = key(None, Range(low=0, high=SEED_MAX, note="(or null to use seed)"), "Seed of the data "
                                "order; null uses the top-level `seed`.")
    merge_adapter: bool = key(False, FLAG, "With peft: also write the base model with the adapters merged in to "
                              "`model/merged/`.")
    lr_find_steps: int = key(200, Range(low=5, high=100_000), "lr=find: steps of the range test, the lr rising "
                             "exponentially from lr_find_start to lr_find_end (fastai's 100 leave the smoothing "
                             "~4 decades behind the lr: benchmarks/results/lr_finder.md).")
    lr_find_start: float = key(1e-7, Range(low=1e-12, high=1), "lr=find: the first lr of the range test (below "
                               "1e-12 a step is lost in fp32 rounding; a subnormal start overflows the lr's rise).")
    lr_find_end: float = key(10.0, Range(low=0, high=1e3, low_open=True), "lr=find: the lr the range test would "
                             "reach at its last step (it stops earlier when the loss diverges).")
    lr_find_rule: str = key("steep", Choice(options=("steep", "minimum", "valley")), "lr=find: how the pick is read "
                            "off the curve: steep (the smoothed loss's steepest descent; the default, closest to a "
                            "grid's best in benchmarks/results/lr_finder.md), minimum (the lr at its minimum / 10), "
                            "valley (half-way along its longest fall).")
    lr_find_only: bool = key(False, FLAG, "lr=find: stop after the range test, without training (`python -m "
                             "llmexp.lr_find` sets it).")


@dataclass
class Config:
    """The whole run. Short top-level keys keep sweeps short."""

    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    precision: PrecisionConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    cluster: ClusterConfig = MISSING
    deepspeed: DeepSpeedConfig = MISSING
    logger: LoggerConfig = MISSING
    peft: PeftConfig = MISSING
    fsdp: FsdpConfig = MISSING
    sweep: SweepConfig = MISSING
    eval: EvalConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    lr: Any = key("auto", Special("a positive finite number, auto or find",
                                  ("0", "-1", "inf", "nan", "-inf", "fast", "[0.001]", "1e400")),
                  "Peak learning rate; auto: from the parameter count by the seed's table; find: a range test first "
                  "(`train.lr_find_*`), then training at its suggestion from a fresh start.")
    batch_size: Any = key(4, Special("an integer >= 1, or auto",
                                     ("0", "-1", "abc", "1.5", "99999999999999999999999", "[4]", "inf")),
                          "Per-device micro-batch size, or auto: the largest that fits in memory (the estimate, then "
                          "a probe step; with `train.global_batch_size` set, a divisor of it per process, "
                          "accumulation making up the rest).")
    seed: int = key(0, Range(low=0, high=SEED_MAX), "Seed of initialisation, dropout and (unless `train.seed_data`) "
                    "the data order.")
    experiment: str | None = key(None, OPTIONAL, "Name of the experiment overlay, set by `experiment/*.yaml`.")


def register_configs() -> None:
    """Register the schemas. Called by the entry point, never at import time."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=Config)


def compose_config(overrides: list[str], run_dir: Path | None = None) -> Any:
    """The config `python -m llmexp OVERRIDES` would get, composed in this process (not validated: see
    `validation.validate`). With `run_dir`, as `hydra.run.dir=RUN_DIR`, with Hydra's config set and the directory
    made, as `@hydra.main` does before its task runs: `llmexp.train.train.train(cfg)` then runs in-process (tests,
    benchmarks, a notebook)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        if run_dir is None:
            return compose("config", overrides=list(overrides))
        cfg = compose("config", overrides=[*overrides, f"hydra.run.dir={run_dir}"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return cfg
