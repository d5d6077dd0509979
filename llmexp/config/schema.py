"""Typed configuration: one dataclass per config group, registered in Hydra's ConfigStore.

The primary config (`llmexp/conf/config.yaml`) extends `Config`, so every group option that Hydra
merges into `model`, `data`, ... is checked against these schemas at compose time: a typo'd
key or a wrong type fails before anything is imported or loaded.

`llmexp.config.validation.validate(cfg)` then checks what a schema cannot express (ranges, cross-field
rules). This module imports no torch: it sits on the `--help` path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf


@dataclass
class ModelConfig:
    """The model: built from these fields with `from_config`, or loaded from `name_or_path`."""

    name: str = "tiny"
    """Label for reports and run names."""
    name_or_path: str | None = None
    """A local directory or hub id to load with `from_pretrained`; null builds from the fields below."""
    gguf_file: str | None = None
    """A GGUF file (llama.cpp's format) in `name_or_path`, loaded instead of its safetensors: transformers dequantises
    it to the run's dtype once per machine (`pip install 'llmexp[gguf]'`); `model/` is then plain safetensors."""
    revision: str | None = None
    """Hub revision (commit hash) to pin; required when `trust_remote_code` is true."""
    trust_remote_code: bool = False
    """Run modelling code shipped with a hub model. Off unless you trust its author."""
    hidden_size: int = 256
    """Width of the residual stream."""
    num_hidden_layers: int = 4
    """Number of transformer blocks."""
    num_attention_heads: int = 4
    """Attention heads per block."""
    num_key_value_heads: int = 4
    """KV heads (grouped-query attention when fewer than the attention heads)."""
    intermediate_size: int = 688
    """Width of the SwiGLU MLP."""
    vocab_size: int = 8192
    """Vocabulary size; the stdlib tokenizer is trained to this size."""
    max_position_embeddings: int = 256
    """Context length the model is built for."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output head."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (a remedy for overfitting)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""


@dataclass
class HfSourceConfig:
    """How `data=hf` reads one dataset: the fields `data` and each `data.mix` entry share."""

    data_files: Any = None
    """hf: the file, glob or list of files a file builder reads."""
    config_name: str | None = None
    """hf: the dataset's configuration (what `datasets.load_dataset` calls `name`)."""
    split: str = "train"
    """hf: the split to train on."""
    eval_split: str | None = None
    """hf: the split to evaluate on; null holds out `data.eval_fraction` of the training rows."""
    text_field: str | None = None
    """hf: the column of plain text (null: found by name: text, prompt/completion, messages, Alpaca's)."""
    prompt_field: str | None = None
    """hf: the prompt column of prompt/completion data."""
    completion_field: str | None = None
    """hf: the completion column of prompt/completion data."""
    messages_field: str | None = None
    """hf: the column of chat messages (a list of {role, content})."""


@dataclass
class MixSourceConfig(HfSourceConfig):
    """One source of `data.mix`: a dataset as `data=hf` reads it, and its share of the training examples."""

    path: str = MISSING
    """A hub id, a `save_to_disk` directory, or a file builder (parquet, arrow, json, csv, text)."""
    weight: float = 1.0
    """This source's share of the training examples, relative to the others' weights (> 0)."""


@dataclass
class DataConfig(HfSourceConfig):
    """Where tokens come from and how they are cut into training examples (the `data=hf` fields inherited)."""

    name: str = "stdlib"
    """Corpus kind: stdlib, stdlib_sft, json, text or hf (the `datasets` library)."""
    train_file: str | None = None
    """json/text: training file (JSON list or JSONL for json; a file, directory or glob for text)."""
    eval_file: str | None = None
    """json/text: evaluation file; null holds out `eval_fraction` of the training records."""
    max_length: int = 256
    """Tokens per example (the block size when packing)."""
    packing: bool = True
    """Pack examples into full blocks; SFT data is padded per example unless this is true."""
    eval_fraction: float = 0.05
    """Share of files (stdlib) or records held out for eval when there is no eval file."""
    tokenizer: str | None = None
    """A tokenizer directory; null uses the model's, or trains a byte-level BPE on the corpus."""
    cache_dir: str = "${oc.env:LLMEXP_CACHE,${oc.env:HOME}/.cache/llmexp}"
    """Where tokenizers and token arrays are cached, keyed by a content hash."""
    num_proc: int = 2
    """Processes for Python-side preparation (stdlib_sft parsing); tokenising uses the tokenizers thread pool."""
    max_examples: int | None = None
    """Use at most this many training records (stdlib_sft and quick experiments)."""
    finetune_only: bool = False
    """Refuse to start without model.name_or_path: this data fine-tunes an earlier run's model."""
    pretrain_lr: float | None = None
    """The lr lr=auto takes for a model trained from scratch on this data (stdlib: 6e-4, measured for the default
    run); a fine-tune (model.name_or_path) or adapters keep lr=auto's own rule, and an explicit lr wins."""
    path: str | None = None
    """hf: a hub id, a `save_to_disk` directory, or a file builder (parquet, arrow, json, csv, text)."""
    mix: list[MixSourceConfig] = field(default_factory=list)
    """hf: several datasets sampled by weight instead of `data.path` (each entry: path, weight, and any of
    data_files, config_name, split, eval_split, *_field). Every 1,000 training examples hold each source's
    share to within one example, in an order that is a pure function of (seed, step)."""
    streaming: bool = False
    """hf: read the train split as training goes (`datasets` streaming) instead of tokenising it into the
    cache first, for corpora larger than memory or the disk cache; needs train.max_steps and a tokenizer."""
    shuffle_window: int = 10000
    """streaming: records are shuffled within consecutive windows of this many, by (seed, epoch, window), so
    resume is exact; larger windows mix more and replay more on resume."""
    stream_eval_rows: int = 1000
    """streaming without data.eval_split: the first this-many rows of the split are the eval set; training
    skips them."""


@dataclass
class PrecisionConfig:
    """Numeric precision of the forward and backward passes; master weights stay in fp32."""

    name: str = "auto"
    """bf16, fp16 (with dynamic loss scaling), fp32, or auto (bf16 where fast, else fp32)."""
    init_scale: float = 65536.0
    """fp16: the first loss scale."""
    growth_interval: int = 2000
    """fp16: steps without overflow before the loss scale doubles."""


@dataclass
class OptimizerConfig:
    """The optimizer; `_target_` must be on the allow-list in `llmexp.config.security`."""

    _target_: str = "torch.optim.AdamW"
    """Optimizer class; only allow-listed classes are instantiated."""
    name: str = "adamw"
    """adamw, adamw8bit, paged_adamw8bit, lion, lion8bit or sgd."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam/Lion betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    momentum: float = 0.0
    """SGD momentum."""
    decay_norms_and_biases: bool = False
    """Also apply weight decay to 1-D params (norms, biases) and embeddings."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra constructor arguments passed as they are."""


@dataclass
class SchedulerConfig:
    """The learning-rate schedule, a pure function of the step (see `llmexp.train.schedule`)."""

    name: str = "cosine"
    """cosine, linear, constant or wsd (warmup-stable-decay)."""
    min_lr_ratio: float = 0.1
    """The lr at the end of decay, as a fraction of the peak lr."""
    decay_ratio: float = 0.2
    """wsd: the fraction of steps spent in the final decay."""


@dataclass
class SlurmJobConfig:
    """One SLURM job's resources and requeue settings: llmexp's `cluster.*` keys and the `llmexp_slurm`
    launcher's `hydra.launcher.*` (hydra_plugins/llmexp_launcher) both hold these fields."""

    partition: str | None = None
    """slurm: partition."""
    nodes: int = 1
    """slurm: nodes per job."""
    gpus_per_node: int = 0
    """slurm: GPUs per node."""
    tasks_per_node: int = 1
    """slurm: tasks (trainer processes) per node."""
    cpus_per_task: int = 1
    """slurm: CPUs per task."""
    mem_gb: int | None = None
    """slurm: memory per node in GB."""
    timeout_min: int = 60
    """slurm: wall-time limit per job in minutes."""
    account: str | None = None
    """slurm: account to charge."""
    qos: str | None = None
    """slurm: quality of service."""
    constraint: str | None = None
    """slurm: node feature constraint."""
    signal_delay_s: int = 120
    """slurm: seconds before the time limit at which the job is signalled to checkpoint."""
    max_num_timeout: int = 3
    """slurm: requeues allowed after timeouts or preemptions."""
    array_parallelism: int = 256
    """slurm: jobs of the array running at once."""
    additional_parameters: dict[str, Any] = field(default_factory=dict)
    """slurm: extra sbatch parameters."""
    setup: list[str] = field(default_factory=list)
    """slurm: shell lines the job script runs before the job, e.g. `module load cuda/12.4` or
    `source ~/venv/bin/activate`. They are written into the sbatch script: keep secrets in the environment."""


@dataclass
class ClusterConfig(SlurmJobConfig):
    """Where sweep jobs run: `local` processes or SLURM through submitit.

    llmexp's short spelling of the launcher's settings: `llmexp/conf/hydra/launcher/cluster_*.yaml` maps
    each key onto `hydra.launcher.*`, where the launchers (`hydra_plugins.llmexp_launcher`) read them."""

    name: str = "local"
    """local or slurm."""
    max_parallel: int = 1
    """local, CPU: jobs run at once (on GPUs: one per GPU times `jobs_per_gpu`)."""
    jobs_per_gpu: int = 1
    """local, GPU: jobs that share one GPU."""
    wait: bool = True
    """Wait for the jobs and write the sweep report; false returns right after submission."""


@dataclass
class DeepSpeedConfig:
    """DeepSpeed ZeRO through Accelerate's plugin; micro-batch, accumulation, clipping and
    precision are derived from the rest of the config."""

    name: str = "none"
    """none, zero2, zero2_offload or zero3."""
    stage: int = 0
    """ZeRO stage (0 = DeepSpeed off)."""
    offload_optimizer: str = "none"
    """none or cpu: keep optimizer state (and its step) on the CPU."""
    offload_param: str = "none"
    """none or cpu: ZeRO-3 parameter offload."""


@dataclass
class FsdpConfig:
    """PyTorch FSDP2 (torch's `fully_shard`; Accelerate's plugin is off on CPU and one process, see
    `llmexp.train.engines.fsdp`): each decoder layer is one unit; its mixed precision follows `precision` and its
    activation checkpointing `model.gradient_checkpointing`. Checkpoints go through DCP and reshard on load."""

    name: str = "none"
    """none (DDP when several processes run), full_shard (parameters, gradients and optimizer state
    sharded: ZeRO-3-like), shard_grad_op (parameters kept whole after the forward: ZeRO-2-like) or
    hybrid_shard (full_shard inside a node, replicated across nodes)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on the CPU between uses."""


@dataclass
class GridSweepConfig:
    """The grid's options (`sweep=grid`); also the `llmexp_grid` Hydra sweeper's, which `sweep.*` maps onto."""

    zip: list[str] = field(default_factory=list)
    """Keys swept together instead of as a product, e.g. [lr,batch_size]: the i-th values pair up."""
    lr_scaling: str = "none"
    """none, sqrt or linear: scale each job's lr by (batch_size / base_batch_size)**(1/2 or 1)."""
    base_batch_size: int | None = None
    """With lr_scaling: the batch size the given lr is for (null: the smallest batch_size swept)."""


@dataclass
class SearchSweepConfig:
    """A search's options (`sweep=random|tpe`); also the `llmexp_search` Hydra sweeper's."""

    n_trials: int = 12
    """Trials in all (those of an earlier, interrupted launch of the same sweep count)."""
    parallel: int = 1
    """Trials at once (GPUs, SLURM array slots or CPU slots)."""
    seed: int = 0
    """The sampler's seed."""
    pruner: str = "none"
    """asha, hyperband, median or none; a trial's eval losses are its intermediate values."""


@dataclass
class SweepConfig(SearchSweepConfig, GridSweepConfig):
    """How `--multirun` explores: Hydra's grid, or an optuna search with pruning from live eval losses."""

    name: str = "grid"
    """grid (every combination, as Hydra's basic sweeper), random or tpe (optuna samplers)."""
    metric: str = "eval_loss"
    """What the search, its pruner, the grid's recommendation and the sweep report rank by: eval_loss, eval_ppl
    or a task metric `tasks/<name>/<metric>` (e.g. tasks/demo/acc) that the jobs' `eval` records."""
    direction: str = "minimize"
    """minimize (losses) or maximize (accuracies)."""


@dataclass
class LoggerConfig:
    """Metric sinks besides `metrics.jsonl` and the console, which are always on."""

    name: str = "jsonl"
    """jsonl, wandb, tensorboard or mlflow."""
    project: str = "llmexp"
    """wandb: project."""
    entity: str | None = None
    """wandb: entity (team)."""
    mode: str = "auto"
    """wandb: online, offline, or auto (offline without WANDB_API_KEY)."""
    init_timeout_s: float = 10.0
    """wandb, mlflow: seconds a start may take to reach the server; past it the run logs locally instead (wandb
    offline, mlflow to the local store; one warning)."""
    tags: list[str] = field(default_factory=list)
    """wandb: tags."""
    tracking_uri: str | None = None
    """mlflow: the tracking server (http://host:5000, https://..., databricks) or a SQLite store
    (sqlite:///path/mlflow.db); null: a SQLite store in the run directory, or the sweep directory for a sweep's
    jobs, which needs no server. Credentials go in MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME/PASSWORD,
    never in the URI."""
    experiment: str = "llmexp"
    """mlflow: the experiment the run (or the sweep's parent run) is logged to; created when missing."""
    log_model: bool = False
    """mlflow: also upload the final `model/` directory as the run's `model` artifact (may be large)."""


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning through the peft library: train low-rank adapters, freeze the base."""

    name: str = "none"
    """none (every weight trains), lora, or qlora (LoRA on a 4-bit NF4 base through bitsandbytes)."""
    r: int = 16
    """LoRA rank: the adapters' inner width."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator: the update is scaled by lora_alpha / r."""
    lora_dropout: float = 0.05
    """Dropout on the adapters' input."""
    target_modules: Any = "all-linear"
    """Which layers get adapters: all-linear (every linear layer of the decoder, per architecture,
    never the output head), or a list of module names such as [q_proj, v_proj]."""
    load_in_4bit: bool = False
    """Load the base weights in 4 bits (qlora sets it)."""
    bnb_4bit_quant_type: str = "nf4"
    """4-bit data type: nf4 (QLoRA's NormalFloat) or fp4."""
    bnb_4bit_use_double_quant: bool = True
    """Quantise the quantisation constants too (about 0.37 bits per weight saved)."""


@dataclass
class PerplexitySetConfig(HfSourceConfig):
    """One extra held-out set (`eval.perplexity.<name>`): the run's `data` with these fields replaced (null keeps
    the run's), scored on its eval split as the eval loss is. Any `data=` source: a json/text file, a `data=hf`
    dataset, e.g. one per source of a `data.mix`."""

    name: str | None = None
    """Corpus kind: stdlib, stdlib_sft, json, text or hf; null: the run's `data.name`."""
    train_file: str | None = None
    """json/text: the file to split (null with eval_file: the whole eval_file is the set)."""
    eval_file: str | None = None
    """json/text: a file scored whole."""
    path: str | None = None
    """hf: a hub id, a `save_to_disk` directory, or a file builder (parquet, arrow, json, csv, text)."""


@dataclass
class ChoiceTaskConfig:
    """A multiple-choice task (`eval.multiple_choice.<name>`), scored by the log-likelihood of each choice."""

    file: str | None = None
    """A JSONL file of {"context": str, "choices": [str, ...], "answer": index}."""
    delimiter: str = " "
    """Put between the context and each choice (lm-evaluation-harness's `target_delimiter`)."""
    max_items: int | None = None
    """Score the first this-many items; null: all."""


@dataclass
class GenerateTaskConfig:
    """A generation task (`eval.generate.<name>`): greedy continuations scored by exact match and containment."""

    file: str | None = None
    """A JSONL file of {"prompt": str, "target": str}."""
    max_new_tokens: int = 32
    """Tokens generated per prompt."""
    stop: list[str] = field(default_factory=lambda: ["\n"])
    """The completion is cut at the first of these strings before it is compared."""
    examples: int = 3
    """Items whose prompt, completion and target are kept in each record (for the report)."""
    max_items: int | None = None
    """Score the first this-many items; null: all."""


@dataclass
class LmEvalConfig:
    """lm-evaluation-harness tasks (`pip install llmexp[eval]`), run on the in-memory model."""

    tasks: list[str] = field(default_factory=list)
    """Harness task names, e.g. [arc_easy, hellaswag], or the names of tasks in `include_path`."""
    include_path: str | None = None
    """A directory of task YAMLs (offline: `dataset_path: json` with `dataset_kwargs.data_files`)."""
    include_defaults: bool = True
    """Also index the harness's built-in tasks (~15,000; ~25 s at the start of a run)."""
    limit: int | None = None
    """Score at most this many documents per task; null: all."""
    num_fewshot: int | None = None
    """Few-shot examples; null: each task's own setting."""
    batch_size: int = 8
    """Requests per forward."""


@dataclass
class EvalConfig:
    """What each eval measures besides the held-out loss: extra held-out sets and downstream tasks, all run at
    every `train.eval_steps` and at the end. Metrics are `tasks/<name>/<metric>`; `sweep.metric` may name one."""

    name: str = "loss"
    """loss (the held-out loss only), demo, perplexity, multiple_choice, generate or lm_eval."""
    perplexity: dict[str, PerplexitySetConfig] = field(default_factory=dict)
    """Extra held-out sets by name: loss and ppl of each."""
    multiple_choice: dict[str, ChoiceTaskConfig] = field(default_factory=dict)
    """Multiple-choice tasks by name: acc and length-normalised acc_norm."""
    generate: dict[str, GenerateTaskConfig] = field(default_factory=dict)
    """Generation tasks by name: exact_match and contains."""
    lm_eval: LmEvalConfig = field(default_factory=LmEvalConfig)
    """lm-evaluation-harness tasks."""
    demo_items: int = 0
    """Items of the demo task ("which line comes next?", from the held-out data); 0: no demo task."""
    batch_size: int = 16
    """Sequences per forward when scoring choices or generating."""


@dataclass
class TrainConfig:
    """The training loop. Names follow HF `TrainingArguments` where it has the same knob."""

    max_steps: int = 250
    """Optimizer steps; -1 trains for `num_train_epochs` instead."""
    num_train_epochs: float = 1.0
    """Epochs over the training set, used when `max_steps` is -1."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step, per process."""
    global_batch_size: int | None = None
    """Examples per optimizer step across all processes; derives the accumulation steps."""
    max_grad_norm: float = 1.0
    """Clip the global grad norm to this after backward, before the step; 0 disables."""
    warmup_ratio: float = 0.05
    """Warmup as a fraction of `max_steps`."""
    warmup_steps: int | None = None
    """Warmup in steps; overrides `warmup_ratio`."""
    weight_decay: float = 0.01
    """Decoupled weight decay (matrices only, unless the optimizer says otherwise)."""
    logging_steps: int = 10
    """Steps between train metric lines."""
    eval_steps: int = 100
    """Steps between evals (also at step 0 and at the end)."""
    eval_batches: int = 16
    """Batches of `batch_size` per eval; -1 evaluates the whole eval set."""
    sample_prompts: list[str] = field(default_factory=list)
    """Prompts the model continues while it trains (metrics.jsonl, console, wandb, report.md); none: no samples."""
    sample_steps: int = 0
    """Steps between samples (also at step 0 and at the end); 0 samples only at the end."""
    sample_max_new_tokens: int = 32
    """Tokens generated per prompt."""
    sample_temperature: float = 0.0
    """0 decodes greedily; above 0 samples at this temperature."""
    sample_seed: int = 0
    """Seed of sampling, on a generator of its own: training's random state is never touched."""
    save_steps: int = 100
    """Steps between checkpoints; 0 saves only at the end and on preemption."""
    save_total_limit: int = 2
    """Checkpoints kept (the best one is kept in addition)."""
    resume: str = "auto"
    """auto (newest complete checkpoint in the run directory), never, or a checkpoint path."""
    resume_data_mismatch: str = "error"
    """A resume whose data fingerprint (corpus, tokenizer, data settings) differs from the
    checkpoint's: error (exit 2, naming both) or warn (resume on the new data)."""
    compile: bool = False
    """torch.compile the model; compile time is reported apart from step time."""
    cpu_matmul: str = "auto"
    """fp32 eager training on a CPU: auto measures torch's matmul (MKL on x86) against oneDNN's at start and takes
    oneDNN where it is faster with equal results (AMD CPUs: ~2x; `llmexp.model.cpu_matmul`); torch keeps torch's."""
    on_anomaly: str = "skip"
    """On a non-finite loss or grad norm: stop, skip the step, or rollback to a checkpoint."""
    max_consecutive_anomalies: int = 5
    """skip: anomalous steps in a row before the run is declared diverged."""
    max_rollbacks: int = 3
    """rollback: rollbacks before the run is declared diverged."""
    rollback_lr_factor: float = 0.5
    """rollback: multiply the lr by this after each rollback."""
    early_stopping_patience: int = 0
    """Evals without improvement before stopping early; 0 disables."""
    peak_tflops: float | None = None
    """Peak TFLOP/s for MFU; null measures a bf16 (or fp32) matmul ceiling at start."""
    seed_data: int | None = None
    """Seed of the data order; null uses the top-level `seed`."""
    merge_adapter: bool = False
    """With peft: also write the base model with the adapters merged in to `model/merged/`."""
    lr_find_steps: int = 100
    """lr=find: steps of the range test, the lr rising exponentially from lr_find_start to lr_find_end."""
    lr_find_start: float = 1e-7
    """lr=find: the first lr of the range test."""
    lr_find_end: float = 10.0
    """lr=find: the lr the range test would reach at its last step (it stops earlier when the loss diverges)."""
    lr_find_only: bool = False
    """lr=find: stop after the range test, without training (`python -m llmexp.lr_find` sets it)."""


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
    lr: Any = "auto"
    """Peak learning rate; auto: from the parameter count by the seed's table; find: a range test first
    (`train.lr_find_*`), then training at its suggestion from a fresh start."""
    batch_size: Any = 4
    """Per-device micro-batch size, or auto: the largest that fits in memory (the estimate, then a probe step;
    with `train.global_batch_size` set, a divisor of it per process, accumulation making up the rest)."""
    seed: int = 0
    """Seed of initialisation, dropout and (unless `train.seed_data`) the data order."""
    experiment: str | None = None
    """Name of the experiment overlay, set by `experiment/*.yaml`."""


def register_configs() -> None:
    """Register the schemas. Called by the entry point, never at import time."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain Python data."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # type: ignore[return-value]
