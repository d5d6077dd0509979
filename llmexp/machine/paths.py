"""Every key that names a file or directory, checked against this machine before anything is written (what is
refused: docs/explanation/bad-input.md). One check per kind of path (`KIND_CHECKS`; a key's kind is the `PathRule` on
its schema field); a path is looked at once with `os.stat`, which follows symbolic links. No torch, no transformers.
"""

from __future__ import annotations

import errno
import glob
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from llmexp.config.keys import leaves
from llmexp.config.rules import PathRule
from llmexp.machine.gguf import gguf_file_problem
from llmexp.machine.task_code import code_in_task_dir
from llmexp.rundir.read import is_run_dir, is_sweep_dir
from llmexp.rundir.readers import NOT_FILES, Damaged, load_json, reader

HF_BUILDERS = ("parquet", "arrow", "json", "csv", "text")
"""`data.path` values that name one of the `datasets` file builders: `data.data_files` says which files."""

PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""Weight files that are pickles: loading one can run code, so a model directory must hold safetensors."""


def _stat(path: Path) -> tuple[os.stat_result | None, str | None]:
    """(the stat of `path` following links, None), (None, None) when it does not exist, or (None, why not)."""
    try:
        return os.stat(path), None
    except FileNotFoundError:
        return None, None
    except OSError as err:
        if err.errno == errno.ELOOP:
            return None, "is a symbolic link loop (or a chain of links too long to follow)"
        if err.errno == errno.ENOTDIR:
            return None, "has a part that is a file, not a directory"
        if err.errno == errno.ENAMETOOLONG:
            return None, "has a name longer than the filesystem allows (shorten it)"
        return None, f"cannot be read ({os.strerror(err.errno or 0) or err})"


def _look(key: str, value: Any, what: str, directory: bool | None) -> tuple[Path, os.stat_result | None, str | None]:
    """The path `value` names, its stat (None: it does not exist), and why it will not do whatever it holds
    (`directory`: which it must be; a special file's size, 0, says nothing of what reading it would give)."""
    path = Path(str(value)).expanduser()
    found, why = _stat(path)
    is_dir = found is not None and stat.S_ISDIR(found.st_mode)
    if found is not None and directory is not None and is_dir != directory:
        why = "is a file, not a directory" if directory else "is a directory"
    elif found is not None and not is_dir and not stat.S_ISREG(found.st_mode):
        why = f"is not a regular file ({NOT_FILES.get(stat.S_IFMT(found.st_mode), 'a special file')})"
    return path, found, why and f"{key}={value}: {why}; point it at {what}"


# ----------------------------------------------------------------------------- directories llmexp writes


def dir_out_problem(key: str, value: Any) -> str | None:
    """A directory llmexp creates and writes (run, sweep, cache): if it exists it is a writable directory; if
    not, its nearest existing parent is one. Never the filesystem's root (what `$UNSET_VAR/` becomes)."""
    path = Path(str(value)).expanduser()
    if not os.path.abspath(path).strip(os.sep):  # `/` (`//`, `/..`): what `hydra.run.dir=$UNSET_VAR/` becomes
        return f"{key}={value}: is the filesystem's root; name a directory of its own for llmexp to write in"
    for place in (path, *path.absolute().parents):
        found, why = _stat(place)
        subject = f"{key}={value}:" + ("" if place is path else f" its parent {place}")
        if why:
            return f"{subject} {why}; set {key} to a directory"
        if found is None:
            continue
        if not stat.S_ISDIR(found.st_mode):
            fix = f"remove it or set {key} to a directory" if place is path else f"set {key} elsewhere"
            return f"{subject} is a file, not a directory; {fix}"
        if long := _name_too_long(path, place):  # (below a missing directory, stat says ENOENT, not ENAMETOOLONG)
            return f"{key}={value}: {long[:40]}... is a name longer than the filesystem allows; shorten it"
        if os.access(place, os.W_OK | os.X_OK):
            return None
        return f"{subject} is not writable by you" if place is path else \
            f"{key}={value}: cannot be created, {place} is not writable by you"
    return None


def _name_too_long(path: Path, place: Path) -> str | None:
    """The first name in `path` below its existing directory `place` that the filesystem there cannot hold."""
    limit = os.pathconf(place, "PC_NAME_MAX")
    return next((p for p in path.absolute().relative_to(place.absolute()).parts if len(os.fsencode(p)) > limit), None)


# ----------------------------------------------------------------------------- files and directories llmexp reads


def _input_file_problem(key: str, value: Any, what: str) -> str | None:
    path, found, problem = _look(key, value, what, directory=False)
    if problem:
        return problem
    if found is None:
        return f"{key}={value}: no such file (looked at {path.absolute()}); fix the path, or point it at {what}"
    return None if found.st_size else f"{key}={value}: is empty (0 bytes); add records, or point it at {what}"


def text_source_files(spec: str) -> list[Path]:
    """data=text's files, sorted: the file itself, every file under a directory but hidden ones (a `.git/` inside
    included, as a glob skips them), or a glob's matches; the empty ones left out (they hold no text)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        files = [p for p in path.rglob("*")
                 if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)]
    else:
        files = [Path(p) for p in glob.iglob(os.path.expanduser(spec), recursive=True) if Path(p).is_file()]
    return sorted(f for f in files if f.stat().st_size > 0)


def _text_source_problem(key: str, value: Any) -> str | None:
    """data=text: a non-empty file, a directory holding one, or a glob that matches one."""
    path, found, problem = _look(key, value, "a text file, a directory of them, or a glob", directory=None)
    if problem:
        return problem
    if found is not None and not stat.S_ISDIR(found.st_mode):
        return None if found.st_size else f"{key}={value}: is empty (0 bytes); add text or point it elsewhere"
    if text_source_files(str(value)):  # a directory's files, or a glob's matches
        return None
    if found is not None:
        return (f"{key}={value}: is a directory with no non-empty file in it (hidden ones are skipped); add text "
                "files or point it elsewhere")
    return (f"{key}={value}: no such file, directory or glob match with text in it (looked at {path.absolute()}); "
            f"fix the path or set {key}=path/to/{'train' if 'train' in key else 'eval'}.txt")


def data_file_problem(cfg: Any, key: str, value: Any, kind: str | None = None) -> str | None:
    """`data.train_file` / `data.eval_file`, or an extra held-out set's (of data kind `kind`): one JSON or JSONL file
    for json, text for text."""
    kind = kind or cfg.data.name
    if kind == "json":
        example = "held_out" if key.startswith("eval.") else "eval" if key == "data.eval_file" else "train"
        return _input_file_problem(key, value, f"a JSON or JSONL file, e.g. {key}=path/to/{example}.jsonl")
    return _text_source_problem(key, value) if kind == "text" else None


def _local_dir(key: str, value: Any, what: str) -> tuple[Path | None, str | None]:
    """(the directory, None) for a local-looking value that is an existing directory; (None, why) when it is
    not one; (None, None) for a hub id."""
    path, found, problem = _look(key, value, what, directory=True)
    if problem or found is not None:
        return (None if problem else path), problem
    local = str(value).startswith((".", "/", "~")) or str(value).count("/") > 1
    return None, (f"{key}={value}: no such directory; point it at {what}" if local else None)


@reader
def read_model_json(path: Path) -> dict[str, Any] | None:
    return load_json(path, read_model_json)


def model_dir_problem(key: str, path: Path, trust_remote_code: bool) -> str | None:
    """What a local model directory must be for llmexp to load it without running code it was not allowed to."""
    shown = f"{key}={path}"
    names = {p.name for p in path.iterdir()}
    if "config.json" not in names:
        if "adapter_config.json" in names and (path / "merged" / "config.json").is_file():  # train.merge_adapter
            return f"{shown}: is a peft adapter; the model merged with it is beside it: {key}={path / 'merged'}?"
        if "adapter_config.json" in names:
            base = (read_model_json(path / "adapter_config.json") or {}).get("base_model_name_or_path") or "<its base>"
            return (f"{shown}: is a peft adapter (adapter_config.json), not a model; set {key}={base} (its base "
                    "model) with peft=lora to train an adapter, or merge this one into its base first "
                    "(PeftModel.from_pretrained(base, DIR).merge_and_unload().save_pretrained(OUT)) and set "
                    f"{key}=OUT")
        if (path / "model" / "config.json").is_file():
            return f"{shown}: is a run directory, not a model; did you mean {key}={path / 'model'}?"
        return f"{shown}: holds no config.json, so it is not a model directory (save_pretrained writes one)"
    config = read_model_json(path / "config.json") or {}
    safetensors = any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names)
    pickled = sorted(n for n in names if n.endswith(PICKLED_WEIGHTS) or n.endswith(".bin.index.json"))
    if not safetensors:
        if not pickled:
            return f"{shown}: holds no weights (model.safetensors); write them with save_pretrained"
        return (f"{shown}: holds pickled weights only ({pickled[0]}): loading a pickle can run code, so llmexp loads "
                "safetensors only. Convert them once, where you trust the file: python -c \"from transformers "
                f"import AutoModelForCausalLM as M; M.from_pretrained('{path}').save_pretrained('{path}-st')\" "
                f"and set {key}={path}-st")
    return code_problem(key, path, config, trust_remote_code, "model.trust_remote_code=true")


def code_problem(key: str, path: Path, config: dict[str, Any], allowed: bool, switch: str | None) -> str | None:
    """A directory whose config maps classes to its own Python files (`auto_map`) runs that code when loaded."""
    auto_map = config.get("auto_map")
    if not auto_map or allowed:
        return None
    refs = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    files = sorted({str(r if isinstance(r, str) else r[0] if r else "").split(".")[0] + ".py" for r in refs} - {".py"})
    how = (f"set {switch} if you trust that code, or use a model of an architecture transformers knows"
           if switch else "llmexp loads it without running code: use a tokenizer transformers knows")
    return (f"{key}={path}: ships code of its own ({', '.join(files) or 'auto_map'} in auto_map), which runs when "
            f"it is loaded; {how}")


def model_problem(cfg: Any, key: str, value: Any) -> str | None:
    """A save_pretrained directory; with `model.gguf_file`, a directory holding that GGUF file instead."""
    what = "a model directory written by save_pretrained (e.g. the model/ of an earlier run) or a hub id"
    path, why = _local_dir(key, value, what)
    if why or path is None:
        return why
    if cfg.model.gguf_file:
        return gguf_file_problem(path / str(cfg.model.gguf_file))
    return model_dir_problem(key, path, bool(cfg.model.trust_remote_code))


def tokenizer_problem(cfg: Any, key: str, value: Any) -> str | None:
    path, why = _local_dir(key, value, "a tokenizer directory written by save_pretrained, or a hub id")
    if why or path is None:
        return why
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return f"{key}={value}: holds no tokenizer ({', '.join(TOKENIZER_FILES)}); save one with save_pretrained"
    file = path / "tokenizer_config.json"
    config = (read_model_json(file) if file.exists() else None) or {}
    return code_problem(key, path, config, False, None) or vocab_problem(cfg, key, path)


def vocab_problem(cfg: Any, key: str, tokenizer_dir: Path) -> str | None:
    """A tokenizer with more ids than a local model has embedding rows (its top ids would index out of range at
    the first forward), when both say their sizes in files: the tokenizer's tokenizer.json, the model's config.json.
    (A hub model or a GGUF file is checked as the run starts, against the model as built.)"""
    m = cfg.model
    model_config = Path(str(m.name_or_path)).expanduser() / "config.json" if m.name_or_path else None
    if model_config is None or m.gguf_file or not model_config.is_file():
        return None
    rows = (read_model_json(model_config) or {}).get("vocab_size")
    if not isinstance(rows, int) or not (tokenizer_dir / "tokenizer.json").is_file():
        return None
    if (ids := read_tokenizer_size(tokenizer_dir / "tokenizer.json")) <= rows:
        return None
    return (f"{key}={tokenizer_dir}: its {ids} token ids outnumber the {rows} embedding rows of "
            f"model.name_or_path={m.name_or_path}; use the model's own tokenizer ({key}=null) or one made for it")


@reader
def read_tokenizer_size(path: Path) -> int:
    """The ids a tokenizer.json hands out: one past the highest of its vocabulary's (a mapping token -> id, or a
    Unigram model's list) and its added tokens'."""
    data = load_json(path, read_tokenizer_size)
    if "model" not in data:
        raise Damaged(path, "it has no model (and so no vocabulary)")
    vocab = data["model"]["vocab"]
    ids = [i for i in vocab.values() if isinstance(i, int)] if isinstance(vocab, dict) else [len(vocab) - 1]
    ids += [token["id"] for token in data.get("added_tokens") or []]
    return max(ids, default=-1) + 1


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")
"""A directory holding none of these holds no tokenizer transformers can load."""


def checkpoint_problem(cfg: Any, key: str, value: Any) -> str | None:
    """`train.resume`: auto, never, or an existing checkpoint directory."""
    if str(value) in ("auto", "never"):
        return None
    fix = "use train.resume=auto, never, or a checkpoints/step_<N> directory"
    path = Path(str(value)).expanduser()
    found, why = _stat(path)
    if why:
        return f"{key}={value}: {why}; {fix}"
    if found is None or not stat.S_ISDIR(found.st_mode):
        return f"{key}={value}: no such checkpoint directory; {fix}"
    if not (path / "manifest.json").is_file():  # a run directory, or its checkpoints/: the newest step in it
        steps = [s for d in (path, path / "checkpoints") for s in d.glob("step_*") if s.name[5:].isdigit()]
        newest = max(steps, key=lambda s: int(s.name[5:]), default=None)
        hint = f" (it holds {newest.relative_to(path)}: train.resume={newest}?)" if newest else ""
        return f"{key}={value}: holds no manifest.json, so it is not an llmexp checkpoint{hint}; {fix}"
    return None


def hf_source_problem(cfg: Any, key: str, value: Any) -> str | None:
    """`data.path` (data=hf): a builder name, a hub id, or a `save_to_disk` directory; never a loading script,
    which `datasets` 4 no longer runs, and llmexp would not (it is code)."""
    if cfg.data.name != "hf" or str(value) in HF_BUILDERS:
        return None
    convert = ("convert the dataset to files where you trust the script (datasets.load_dataset(...)"
               ".to_parquet(FILE)), then set data.path=parquet data.data_files=FILE")
    if str(value).endswith(".py"):
        return f"{key}={value}: is a dataset loading script (code); llmexp runs no code from data: {convert}"
    path, why = _local_dir(key, value, "a save_to_disk directory, a hub id, or a file builder (data.path=parquet "
                                       "data.data_files=FILE)")
    if why or path is None:
        return why
    if (path / f"{path.name}.py").is_file():
        return f"{key}={value}: needs its loading script {path.name}.py (code), which llmexp does not run: {convert}"
    if not any(p.is_file() for p in path.rglob("*")):
        return f"{key}={value}: is a directory with no file in it; point it at a save_to_disk directory"
    return None


def builder_files_problem(key: str, value: Any, source: Any) -> str | None:
    """`data_files` read from this machine for the dataset `source` (`data.path`, a `data.mix` entry's `path`) when
    it is a builder or a local directory, not a hub repo's own files: a file, glob or list of them, each matching
    non-empty regular files."""
    source = str(source or "")
    if not (source in HF_BUILDERS or Path(source).expanduser().is_dir()):
        return None
    specs = [value] if isinstance(value, str) else list(value.values()) if hasattr(value, "values") else value
    flat = [s for spec in specs for s in ([spec] if isinstance(spec, str) else list(spec))]
    if not flat or not all(isinstance(s, str) and s.strip() for s in flat):
        return f"{key}={value}: must be a file, a glob, or a list of them; e.g. {key}=/data/train.parquet"
    base = Path(source).expanduser() if source not in HF_BUILDERS else Path()
    source_key = key.removesuffix("data_files") + "path"  # data.path, data.mix[i].path: the key beside this one
    for spec in flat:
        pattern = base / os.path.expanduser(spec)
        for match in [Path(p) for p in glob.iglob(str(pattern), recursive=True)] or [pattern]:
            if problem := _input_file_problem(key, match, f"files for {source_key}={source}"):
                return problem
    return None


def task_dir_problem(cfg: Any, key: str, value: Any) -> str | None:
    """`eval.lm_eval.include_path`: an existing directory with a task YAML in it (the harness indexes them all)."""
    what = "a directory of lm-evaluation-harness task YAMLs"
    path, found, problem = _look(key, value, what, directory=True)
    if problem or found is None:
        return problem or f"{key}={value}: no such directory (looked at {path.absolute()}); point it at {what}"
    if not any(p.is_file() for p in path.rglob("*.yaml")):
        return f"{key}={value}: holds no task YAML (*.yaml); add one, or point it at {what}"
    if cfg.eval.lm_eval.trust_code or not (code := code_in_task_dir(path)):
        return None
    more = f" (and {len(code) - 1} more)" if len(code) > 1 else ""
    return (f"{key}={value}: its task YAMLs would run Python code: {code[0]}{more}; set "
            "eval.lm_eval.trust_code=true if you trust the folder's author, or remove the code")


def task_file_errors(cfg: Any) -> list[str]:
    """The `eval` group's task files and extra held-out sets' files, entries of dicts, which have no `PathRule` of
    their own (a task file's lines are read and checked when the run starts)."""
    ev, problems = cfg.eval, []
    shapes = {"multiple_choice": '{"context", "choices", "answer"}', "generate": '{"prompt", "target"}'}
    for kind, shape in shapes.items():
        problems += [_input_file_problem(f"eval.{kind}.{name}.file", task.file, f"a JSONL file of {shape} records")
                     for name, task in ev[kind].items() if task.file]
    for name, entry in ev.perplexity.items():
        problems += [data_file_problem(cfg, f"eval.perplexity.{name}.{field}", entry[field], entry.name)
                     for field in ("train_file", "eval_file") if entry[field]]
    return [problem for problem in problems if problem]


KIND_CHECKS: dict[str, Callable[[Any, str, Any], str | None]] = {
    "dir_out": lambda cfg, key, value: dir_out_problem(key, value),
    "data_file": data_file_problem,
    "model": model_problem,
    "tokenizer": tokenizer_problem,
    "checkpoint": checkpoint_problem,
    "hf_source": hf_source_problem,
    "hf_files": lambda cfg, key, value: (builder_files_problem(key, value, cfg.data.path)
                                         if cfg.data.name == "hf" else None),
    "task_dir": task_dir_problem,
}
"""One check per kind of path (`rules.PATH_KINDS`); `tests/test_schema_property.py` asserts they match."""


def path_errors(cfg: Any) -> list[str]:
    """Every path key of the schema (a `rules.PathRule` on its field; each `data.mix` source's too) that breaks
    its kind's rule, and the run or sweep directory this launch writes."""
    problems = [KIND_CHECKS[kind](cfg, key, value) for key, kind in _path_keys().items()
                if kind != "dir_out" and (value := OmegaConf.select(cfg, key)) not in (None, "")]
    return directory_errors(cfg) + [p for p in problems if p] + mix_errors(cfg) + task_file_errors(cfg)


def mix_errors(cfg: Any) -> list[str]:
    """Each `data.mix` source's `path` and `data_files`, checked as `data.path` and `data.data_files` are (entries
    of a list have no `PathRule` of their own)."""
    problems = []
    for i, source in enumerate(cfg.data.mix if cfg.data.name == "hf" else []):
        if source.get("path"):  # (no dataset named: the config's validation says so)
            problems.append(hf_source_problem(cfg, f"data.mix[{i}].path", source.path))
            if source.data_files not in (None, ""):
                problems.append(builder_files_problem(f"data.mix[{i}].data_files", source.data_files, source.path))
    return [problem for problem in problems if problem]


def _path_keys() -> dict[str, str]:
    return {leaf.key: leaf.rule.kind for leaf in leaves().values() if isinstance(leaf.rule, PathRule)}


def directory_errors(cfg: Any) -> list[str]:
    """The directories this launch writes: the cache, and `hydra.run.dir` for a run or `hydra.sweep.dir` for a
    sweep when the config holds Hydra's node (the CLI's checks; a job's own process has none)."""
    keys = [k for k, kind in _path_keys().items() if kind == "dir_out"]
    hydra = cfg.get("hydra") if isinstance(cfg, DictConfig) else None
    if isinstance(hydra, DictConfig):
        keys.append("hydra.sweep.dir" if str(hydra.get("mode")) == "RunMode.MULTIRUN" else "hydra.run.dir")
    return [problem for key in keys if (value := OmegaConf.select(cfg, key)) not in (None, "")
            and (problem := dir_out_problem(key, value) or _other_kind(key, value))]


def _other_kind(key: str, value: Any) -> str | None:
    """A run into a sweep's directory, or a sweep into a run's: the reports and `llmexp.status` would see only one
    of the two. (A run's own directory, rerun to resume, is a run's; a sweep's, a sweep's.)"""
    path = Path(str(value)).expanduser()
    if key == "hydra.run.dir" and is_sweep_dir(path) and not is_run_dir(path):
        return (f"{key}={value} holds a sweep (multirun.yaml, job directories); a single run there would hide it "
                f"from llmexp.report and llmexp.status: choose another {key}")
    if key == "hydra.sweep.dir" and is_run_dir(path) and not (path / "multirun.yaml").is_file():
        return (f"{key}={value} holds a single run (metrics.jsonl, summary.json, .hydra/); a sweep there would hide "
                f"it from llmexp.report and llmexp.status: choose another {key}")
    return None
