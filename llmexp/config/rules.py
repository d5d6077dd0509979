"""The rule of every leaf of the schema: which values it takes. `validation.rule_for(key)` finds it.

Numbers have a `Range` (`validation.RANGES`); every other leaf has one entry in `RULES`:

- `Choice`: one of a fixed set of names (an option's `name`, a policy);
- `Text`: free text passed on as it is (a label, a split, a SLURM partition): set, it is not empty, and not huge;
- `TextList`: a list whose items are each such a `Text`;
- `Flag`: true or false (the schema's type is the whole rule);
- `PathRule`: a file or directory, checked against the machine by `environment.check_environment`
  (missing, empty, a file for a directory and the reverse, a symbolic link loop);
- `Special`: a value with a rule of its own, checked where `where` says; `bad` lists values it refuses.

The launchers' and sweepers' settings (`hydra.launcher.*`, `hydra.sweeper.*`) are the `cluster.*` and
`sweep.*` leaves under another name (`MIRRORS`), plus the few of their own in `HYDRA_RULES`.
`tests/test_schema_property.py` walks the schema and fails for a leaf without a rule, and feeds every rule
the values it must refuse. No torch, no Hydra here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# The names each group's options give themselves (`name:` in llmexp/conf/<group>/*.yaml).
PRECISIONS = ("bf16", "fp16", "fp32", "auto")
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit", "lion", "lion8bit", "sgd")
SCHEDULERS = ("cosine", "linear", "constant", "wsd")
ANOMALY_POLICIES = ("stop", "skip", "rollback")
DATA_KINDS = ("stdlib", "stdlib_sft", "json", "text", "hf")
LOGGERS = ("jsonl", "wandb", "tensorboard", "mlflow")
PEFT_METHODS = ("none", "lora", "qlora")
FSDP_STRATEGIES = ("none", "full_shard", "shard_grad_op", "hybrid_shard")
SWEEP_STRATEGIES = ("grid", "random", "tpe")
SAMPLERS = ("random", "tpe")
PRUNERS = ("none", "asha", "hyperband", "median")
LR_SCALINGS = ("none", "sqrt", "linear")
CPU_MATMULS = ("auto", "torch")
EVAL_OPTIONS = ("loss", "demo", "perplexity", "multiple_choice", "generate", "lm_eval")
DIRECTIONS = ("minimize", "maximize")


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
            text = f"must be {'>' if self.low_open else '>='} {fmt_bound(self.low)}"
        else:
            text = (f"must be in {'(' if self.low_open else '['}{fmt_bound(self.low)}, "
                    f"{fmt_bound(self.high)}{')' if self.high_open else ']'}")
        text += "".join(f" or {v}" for v in self.also)
        return f"{text} {self.note}" if self.note else text


INT64_MAX = 2**63 - 1
"""The largest int torch, numpy and the checkpoint's JSON round trip all take as a signed 64-bit value."""
SEED_MAX = 2**64 - 1
"""torch.manual_seed and numpy's generators take seeds up to 2**64 - 1."""


def fmt_bound(bound: float) -> str:
    return "2**64 - 1" if bound == SEED_MAX else "2**63 - 1" if bound == INT64_MAX else f"{bound:g}"


@dataclass(frozen=True)
class Choice:
    """One of `options`."""

    options: tuple[str, ...]

    def problem(self, key: str, value: Any) -> str | None:
        if value in self.options:
            return None
        return f"{key}: {value!r} is not one of {', '.join(self.options)}"


@dataclass(frozen=True)
class Text:
    """Free text passed on as it is. Unset (null) is allowed when `nullable`; set, it is not empty, at most
    `max_len` characters, and (when `one_line`) a single line: no tool that receives these takes an empty name,
    a newline inside one, or a megabyte of it."""

    nullable: bool = True
    max_len: int = 1000
    one_line: bool = True

    def problem(self, key: str, value: Any) -> str | None:
        if value is None:
            return None if self.nullable else f"{key}: must be set"
        text = str(value)
        if not text.strip():
            return f"{key}: must not be empty" + ("; leave it out (null) instead" if self.nullable else "")
        if len(text) > self.max_len:
            return f"{key}: is {len(text)} characters long; at most {self.max_len}"
        if self.one_line and ("\n" in text or "\r" in text):
            return f"{key}: must be one line"
        return None


@dataclass(frozen=True)
class TextList:
    """A list of `item`s."""

    item: Text

    def problem(self, key: str, value: Any) -> str | None:
        for i, item in enumerate(value or []):
            if problem := self.item.problem(f"{key}[{i}]", item):
                return problem
        return None


@dataclass(frozen=True)
class Flag:
    """true or false: the schema's boolean type is the whole rule."""


PATH_KINDS = {
    "dir_out": "a directory llmexp creates and writes: if it exists it is a directory, and so is its nearest "
               "existing parent",
    "data_file": "data=json: an existing, non-empty JSON/JSONL file; data=text: a non-empty file, a directory "
                 "holding files, or a glob matching files",
    "model": "a local model directory (config.json and safetensors weights, no code unless trusted), or a hub id",
    "tokenizer": "a local tokenizer directory (no code unless trusted), or a hub id",
    "checkpoint": "auto, never, or an existing checkpoint directory",
    "hf_source": "data=hf: a hub id, a save_to_disk directory, or a file builder (parquet, arrow, json, csv, text); "
                 "never a loading script",
    "hf_files": "data=hf: a file, glob or list of them, each matching non-empty files",
    "task_dir": "an existing directory holding lm-evaluation-harness task YAMLs (*.yaml)",
}
"""What each kind of path key names; `environment.check_environment` checks them before anything is written."""


@dataclass(frozen=True)
class PathRule:
    """A file or directory (`PATH_KINDS`), checked on this machine before anything is written
    (`paths.KIND_CHECKS`); what needs no machine (set but empty, longer than a path can be) is `problem`'s."""

    kind: str

    def problem(self, key: str, value: Any) -> str | None:
        if value is None or not isinstance(value, str):
            return None  # unset; a list of files (data.data_files) is judged on the machine
        if not value.strip():
            return f"{key}: must not be empty; leave it out (null), or name a path"
        if len(value) > PATH_MAX:
            return f"{key}: is {len(value)} characters long; no path is longer than {PATH_MAX}"
        return None


PATH_MAX = 4096
"""Linux's longest path (PATH_MAX)."""


@dataclass(frozen=True)
class Special:
    """A value with a rule of its own, checked in `where`; `bad` are values it refuses (override syntax);
    `sweep_only`: read only by a sweep, so checked before one launches (`llmexp.sweep.check`)."""

    where: str
    bad: tuple[str, ...]
    sweep_only: bool = False


_LABEL = Text(nullable=False)
_OPTIONAL = Text()

RULES: dict[str, Any] = {
    "model.name": _LABEL,
    "model.name_or_path": PathRule("model"),
    "model.revision": _OPTIONAL,
    "model.trust_remote_code": Flag(),
    "model.gguf_file": Special("validation._validate_gguf: a file inside model.name_or_path, no 4-bit base; "
                               "environment: a GGUF file transformers can load", ("''", "x.gguf", "'  '")),
    "model.tie_word_embeddings": Flag(),
    "model.gradient_checkpointing": Flag(),
    "data.data_files": PathRule("hf_files"),
    "data.config_name": _OPTIONAL,
    "data.split": _LABEL,
    "data.eval_split": _OPTIONAL,
    "data.text_field": _OPTIONAL,
    "data.prompt_field": _OPTIONAL,
    "data.completion_field": _OPTIONAL,
    "data.messages_field": _OPTIONAL,
    "data.name": Choice(DATA_KINDS),
    "data.train_file": PathRule("data_file"),
    "data.eval_file": PathRule("data_file"),
    "data.packing": Flag(),
    "data.tokenizer": PathRule("tokenizer"),
    "data.cache_dir": PathRule("dir_out"),
    "data.finetune_only": Flag(),
    "data.path": PathRule("hf_source"),
    "data.mix": Special("validation._validate_mix: each source a path and a positive weight, data=hf only",
                        ("[{weight: 1.0}]", "[{path: x, weight: 0.0}]", "[{path: x, weight: inf}]",
                         "[{path: x, weight: -1.0}]")),
    "data.streaming": Flag(),
    "precision.name": Choice(PRECISIONS),
    "optimizer._target_": Special("security.target_errors: an allow-listed optimizer class",
                                  ("builtins.open", "os.system", "torch.optim.__builtins__", "")),
    "optimizer.name": Choice(OPTIMIZERS),
    "optimizer.betas": Special("validation._number_errors: two numbers in [0, 1)",
                               ("[0.9]", "[0.9,1.0]", "[0.9,inf]", "[-0.1,0.9]", "[]", "[0.9,0.99,0.999]")),
    "optimizer.decay_norms_and_biases": Flag(),
    "optimizer.kwargs": Special("validation._kwargs_errors: passed as they are, floats finite",
                                ("{foreach_eps: inf}", "{x: nan}")),
    "scheduler.name": Choice(SCHEDULERS),
    "cluster.partition": _OPTIONAL,
    "cluster.account": _OPTIONAL,
    "cluster.qos": _OPTIONAL,
    "cluster.constraint": _OPTIONAL,
    "cluster.additional_parameters": Special("validation._kwargs_errors: sbatch options, floats finite",
                                             ("{x: inf}",)),
    "cluster.setup": TextList(Text(nullable=False)),
    "cluster.name": Choice(("local", "slurm")),
    "cluster.wait": Flag(),
    "deepspeed.name": _LABEL,
    "deepspeed.offload_optimizer": Choice(("none", "cpu")),
    "deepspeed.offload_param": Choice(("none", "cpu")),
    "logger.name": Choice(LOGGERS),
    "logger.project": _LABEL,
    "logger.entity": _OPTIONAL,
    "logger.mode": Choice(("auto", "online", "offline", "disabled")),
    "logger.tags": TextList(Text(nullable=False, max_len=64)),  # wandb refuses longer tags
    "logger.tracking_uri": Special("validation.tracking_uri_problem: null, or an MLflow server, SQLite or Databricks "
                                   "URI without credentials", ("file:///tmp/mlruns", "ftp://x", "http://u:p@h:5000")),
    "logger.experiment": Text(nullable=False, max_len=256),  # MLflow's SQL stores keep it in a VARCHAR(256)
    "logger.log_model": Flag(),
    "peft.name": Choice(PEFT_METHODS),
    "peft.target_modules": Special("validation._validate_peft: all-linear or a list of module names",
                                   ("[]", "5", "['']", "some-linear")),
    "peft.load_in_4bit": Flag(),
    "peft.bnb_4bit_quant_type": Choice(("nf4", "fp4")),
    "peft.bnb_4bit_use_double_quant": Flag(),
    "fsdp.name": Choice(FSDP_STRATEGIES),
    "fsdp.cpu_offload": Flag(),
    "sweep.zip": TextList(Text(nullable=False, max_len=200)),
    "sweep.lr_scaling": Choice(LR_SCALINGS),
    "sweep.pruner": Choice(PRUNERS),
    "sweep.name": Choice(SWEEP_STRATEGIES),
    "sweep.metric": Special("validation.metric_errors: eval_loss, eval_ppl, or tasks/<name>/<metric> of a task this "
                            "config's eval runs (a sweep checks every job's before it launches)",
                            ("accuracy", "tasks/demo/acc", "", "tasks//acc", "tasks/demo", "eval_loss/x")),
    "sweep.direction": Choice(DIRECTIONS),
    "eval.name": Choice(EVAL_OPTIONS),
    "eval.perplexity": Special("validation._validate_tasks: each set's name, data kind and source",
                               ("{p: {name: jsonl}}", "{p: {name: json}}", "{p: {name: hf}}", "{a+b: {name: stdlib}}")),
    "eval.multiple_choice": Special("validation._validate_tasks: each task's name, file and TASK_RANGES; its file: "
                                    "paths.task_file_errors", ("{mc: {max_items: 2}}", "{mc: {file: ''}}",
                                                               "{mc: {file: /nonexistent/mc.jsonl}}",
                                                               "{mc: {file: x.jsonl, max_items: 0}}",
                                                               "{a+b: {file: x.jsonl}}")),
    "eval.generate": Special("validation._validate_tasks: each task's name, file, stop strings and TASK_RANGES; its "
                             "file: paths.task_file_errors", ("{qa: {max_new_tokens: 5}}",
                                                              "{qa: {file: /nonexistent/qa.jsonl}}",
                                                              "{qa: {file: x.jsonl, max_new_tokens: 0}}",
                                                              "{qa: {file: x.jsonl, examples: -1}}",
                                                              "{qa: {file: x.jsonl, stop: ['']}}")),
    "eval.lm_eval.tasks": TextList(Text(nullable=False, max_len=200)),
    "eval.lm_eval.include_path": PathRule("task_dir"),
    "eval.lm_eval.include_defaults": Flag(),
    "train.sample_prompts": TextList(Text(nullable=False, max_len=10_000, one_line=False)),
    "train.resume": PathRule("checkpoint"),
    "train.resume_data_mismatch": Choice(("error", "warn")),
    "train.compile": Flag(),
    "train.on_anomaly": Choice(ANOMALY_POLICIES),
    "train.cpu_matmul": Choice(CPU_MATMULS),
    "train.merge_adapter": Flag(),
    "train.lr_find_only": Flag(),
    "lr": Special("validation._number_errors: a positive finite number, auto or find",
                  ("0", "-1", "inf", "nan", "-inf", "fast", "[0.001]", "1e400")),
    "batch_size": Special("validation._number_errors: an integer >= 1, or auto",
                          ("0", "-1", "abc", "1.5", "99999999999999999999999", "[4]", "inf")),
    "experiment": _OPTIONAL,
}
"""The rule of every leaf of `schema.Config` that is not a number (numbers: `validation.RANGES`)."""

MIRRORS: dict[str, str] = {"hydra.launcher.": "cluster.", "hydra.sweeper.": "sweep."}
"""The launchers' and sweepers' settings that are llmexp's `cluster.*` and `sweep.*` under another name."""

HYDRA_RULES: dict[str, Any] = {
    "hydra.launcher._target_": Special("security: llmexp's launchers or Hydra's basic one", ("os.system",)),
    "hydra.launcher.submitit_folder": Special("security: inside the sweep directory", ("/tmp/elsewhere/%j",)),
    "hydra.sweeper._target_": Special("security: llmexp's sweepers or Hydra's basic one", ("os.system",)),
    "hydra.sweeper.sampler": Choice(SAMPLERS),
    "hydra.sweeper.max_batch_size": Range(low=1, note="(or null: every job at once)"),
    "hydra.sweeper.params": Special("sweep.check: each entry a swept override, checked like the command line's",
                                    ("{lr: 'interval(1,0)'}",), sweep_only=True),
}
"""The rules of the launchers' and sweepers' own settings (those `MIRRORS` does not cover)."""
