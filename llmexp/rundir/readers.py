"""Every file llmexp reads, listed in one place with its kind, and the primitives its readers share.

What a damaged file of each kind (INPUT: a user's file; CACHE: one llmexp made to save time; RECORD: one a run or
sweep wrote) owes the user: docs/reference/files.md, and docs/explanation/bad-input.md ("Every file llmexp reads").

A reader takes the file's path; it is registered in `READERS` under its `module:qualname` and decorated `@reader`,
which gives it its kind's duty (an unregistered `@reader` fails at import). A reader whose damage its caller handles
(a checkpoint: `CorruptCheckpoint`; a token cache array: `data.cache.cached`) names that caller as its `duty`.
tests/test_readers.py feeds every `@reader` damaged files and fails on a file read anywhere else in llmexp/ or
hydra_plugins/ (`OTHER_OPENS`: opens that parse no file's content, and why). No torch here.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import logging
import math
import os
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar, get_args

from llmexp.errors import UserError, first_line

INPUT, CACHE, RECORD = "input", "cache", "record"
KiB, MiB = 1 << 10, 1 << 20
MAX_DEPTH = 64
"""Nesting deeper than this in a JSON or YAML file is damage: no file llmexp reads nests more than a few levels."""

log = logging.getLogger("llmexp.readers")


@dataclass(frozen=True)
class Reader:
    """A file's reader: its kind, the file as the user meets it, `fix` (INPUT: what the file must hold; CACHE: what
    happens instead), the most bytes the file (`max_bytes`; None: any) or a line may hold, the `fields` it checks
    by type (`check_fields`), and `duty`: the caller that does the kind's duty when this reader raises."""

    kind: str
    file: str
    fix: str = ""
    max_bytes: int | None = MiB
    max_line_bytes: int | None = None
    fields: Any = None
    duty: str | None = None


@dataclass(frozen=True)
class Need:
    """A field an object cannot do without: missing or unfit, the whole object does not fit."""

    spec: Any


FINDING = {"kind": Need(str), "step": Need(int), "severity": Need(str), "message": Need(str), "advice": Need(str)}
RUN_SUMMARY = {"status": str | None, "step": int | None, "train_loss": float | None, "eval_loss": float | None,
               "eval_ppl": float | None, "tokens_per_sec": float | None, "mfu": float | None, "lr": float | None,
               "precision": str | None, "findings": [FINDING], "tasks": dict | None, "overrides": [str],
               "error": str | None}
METRIC = {"step": Need(int), "event": str, "loss": float | None, "eval_loss": float | None, "eval_ppl": float | None,
          "time_s": float | None, "max_steps": int | None, "task": str, "metrics": dict}
JOB_OUTCOME = {"num": Need(int), "status": Need(str), "exit_code": int | None, "error": str | None,
               "job_id": str | None}
JOB_STATUS = {"status": str, "exit_code": int | None, "error": str | None, "job_id": str | None, "overrides": [str]}
MLFLOW_RUN = {"tracking_uri": Need(str), "experiment_id": str, "run_id": Need(str)}
LR_FIND = {"suggestion": Need(float), "lr_find_steps": Need(int), "lr_find_start": Need(float),
           "lr_find_end": Need(float)}
MATMUL_VERDICT = {"path": Need(str), "reason": Need(str), "speedup": Need(float), "max_rel_diff": Need(float | None)}
TOKENIZER_JSON = {"model": {"vocab": Need(dict | list)}, "added_tokens": [{"id": Need(int)}]}
CHECKPOINT = "llmexp.checkpoint.store:load_with_fallback"
TOKEN_CACHE = "llmexp.data.cache:cached"

DATA_FIX = "one JSON object per line (JSONL) or one JSON list of objects with `text`, `prompt` + `completion`, " \
    "or `messages`"
READERS: dict[str, Reader] = {  # module:qualname -> Reader
    "llmexp.data.corpora:read_json_records": Reader(INPUT, "data.train_file (json)", DATA_FIX, None),
    "llmexp.data.corpora:read_text": Reader(INPUT, "data.train_file (text)", "UTF-8 text", None),
    "llmexp.data.corpora:read_source": Reader(INPUT, "the stdlib corpus's .py files", "Python source", 16 * MiB),
    "llmexp.evals.items:_json_lines": Reader(INPUT, "task JSONL (eval.<kind>.<name>.file)", "JSONL", None, MiB),
    "llmexp.machine.gguf:read_architecture": Reader(INPUT, "model.gguf_file", "a whole .gguf file from llama.cpp (or "
                                                   "drop model.gguf_file to load the directory's safetensors)", None),
    "llmexp.config.origin:read_config_yaml": Reader(INPUT, "a config YAML", "YAML", 16 * MiB),
    "llmexp.machine.task_code:read_task_yaml": Reader(INPUT, "a harness task YAML (eval.lm_eval.include_path)",
                                                     "YAML in lm-evaluation-harness's task format", 16 * MiB),
    "llmexp.machine.paths:read_model_json": Reader(INPUT, "a model's config.json, adapter_config.json, "
                                                  "tokenizer_config.json", "a JSON object", 16 * MiB, None, {str: Any}),
    "llmexp.machine.paths:read_tokenizer_size": Reader(INPUT, "a tokenizer's tokenizer.json", "a tokenizers JSON "
                                                      "file (save_pretrained writes one)", 256 * MiB,
                                                      fields=TOKENIZER_JSON),
    "llmexp.machine.environment:_sqlite_errors": Reader(INPUT, "logger.tracking_uri's SQLite file",
                                                       duty="llmexp.config.validation:validate"),
    "llmexp.train.lr_find:read_lr_find": Reader(CACHE, "lr_find.json", "the range test runs again", 16 * MiB,
                                                fields=LR_FIND),
    "llmexp.model.cpu_matmul:read_verdicts": Reader(CACHE, "cpu_matmul.json", "the matmul path is probed again",
                                                    fields={str: MATMUL_VERDICT}),
    "llmexp.monitor.throughput:load_ceilings": Reader(CACHE, "peak_tflops.json", "the matmul ceiling is measured "
                                                      "again", fields={str: float}),
    "llmexp.data.cache:load_meta": Reader(CACHE, "a data cache entry's meta.json", "the entry is built again",
                                          64 * MiB, fields={"files": {str: list}}),
    "llmexp.data.datasets:TokenDataset.load": Reader(CACHE, "tokens/<key>/*.npy", duty=TOKEN_CACHE),
    "llmexp.data.datasets:TokenDataset.load.<locals>.get": Reader(CACHE, "tokens/<key>/*.npy", duty=TOKEN_CACHE),
    "llmexp.data.datasets:build_datasets.<locals>.load": Reader(CACHE, "tokens/<key>/*.npy", duty=TOKEN_CACHE),
    "llmexp.data.tokenizer:trained_tokenizer.<locals>.load": Reader(CACHE, "tokenizers/<key>/", duty=TOKEN_CACHE),
    "llmexp.rundir.read:read_metrics": Reader(RECORD, "metrics.jsonl", "", None, MiB, METRIC),
    "llmexp.rundir.read:read_summary": Reader(RECORD, "summary.json", "", 64 * MiB, fields=RUN_SUMMARY),
    "llmexp.rundir.read:read_job_status": Reader(RECORD, "job_status.json", fields=JOB_STATUS),
    "llmexp.rundir.read:read_slurm_jobs": Reader(RECORD, "slurm_jobs.json", "", 16 * MiB, fields={"jobs": {str: str}}),
    "llmexp.rundir.readers:read_yaml": Reader(RECORD, ".hydra/*.yaml, multirun.yaml", "", 16 * MiB),
    "llmexp.rundir.tracking:read_run_file": Reader(RECORD, "mlflow_run.json", fields=MLFLOW_RUN),
    "llmexp.rundir.lock:lock_pid": Reader(RECORD, ".llmexp.lock", max_bytes=KiB),
    "llmexp.rundir.lock:read_hydra_file": Reader(RECORD, ".hydra/*.yaml, kept to be put back", "", 16 * MiB),
    "llmexp.rundir.study:read_journal": Reader(RECORD, "study.journal", max_bytes=None),
    "llmexp.sweep.local:read_outcome": Reader(RECORD, ".llmexp/<N>.outcome.json", fields=JOB_OUTCOME),
    "llmexp.sweep.local:read_pickle": Reader(RECORD, ".llmexp/<N>.job.pkl, <N>.return.pkl", max_bytes=None),
    "llmexp.checkpoint.store:read_manifest": Reader(RECORD, "checkpoints/step_<N>/manifest.json", duty=CHECKPOINT),
    "llmexp.checkpoint.serialize:load_tensors": Reader(RECORD, "checkpoints/step_<N>/*.safetensors", duty=CHECKPOINT),
    "llmexp.checkpoint.serialize:load_state": Reader(RECORD, "checkpoints/step_<N>/*.pt", duty=CHECKPOINT),
    "llmexp.checkpoint.dcp:read_metadata": Reader(RECORD, "checkpoints/step_<N>/dcp/.metadata", duty=CHECKPOINT),
    "llmexp.train.resume:_read_trainer_state": Reader(RECORD, "checkpoints/step_<N>/trainer_state.json",
                                                     duty=CHECKPOINT),
}
"""Every reader of a file, by `module:qualname`."""

OTHER_OPENS: dict[str, str] = {
    "llmexp.rundir.files:fsync_path": "opens a file or directory to fsync it; reads nothing",
    "llmexp.rundir.lock:lock_holder": "/proc/locks, the kernel's table of locks",
    "llmexp.machine.precision:_cpu_flags_have_bf16": "/proc/cpuinfo, the kernel's word on the CPU",
    "llmexp.monitor.throughput:peak_rss_mb": "/proc/self/status, the kernel's word on this process",
    "llmexp.monitor.throughput:process_age_s": "/proc/self/stat, the kernel's word on this process",
    "llmexp.config.validation:_default_option": "llmexp's own conf/config.yaml, installed with the package",
    "llmexp.config.tree:option_names": "llmexp's own conf/<group>/*.yaml, installed with the package",
    "llmexp.train.resume:base_model_fingerprint": "hashes a local base's config.json (an input that "
                                                  "`machine.paths.read_model_json` checked)",
    "llmexp.checkpoint.dcp:safe_planner.<locals>.SafePlanner.load_bytes": "bytes DCP read from a checkpoint "
                                                                           "`verify_checkpoint` hashed",
}
"""Functions that open a file without being a reader of its content, and why."""


# ----------------------------------------------------------------------------- the kinds' duties


class Damaged(ValueError):
    """A file that is not what its reader expects: the path, the line where one is known, and why."""

    def __init__(self, path: Path | str, why: str, line: int | None = None) -> None:
        self.path, self.why, self.line = Path(path), why, line
        super().__init__(f"{path}{f':{line}' if line else ''}: {why}")


_said: set[str] = set()


def skipped(what: str, level: int = logging.WARNING) -> None:
    """A record's one line saying what was skipped (a cache's, at INFO), once per process: a `--watch` redraws, a
    cache is read again, without repeating it."""
    if (line := f"llmexp: skipped {what}" if level == logging.WARNING else f"llmexp: {what}") not in _said:
        _said.add(line)
        log.log(level, line)


F = TypeVar("F", bound=Callable[..., Any])


def reader(fn: F) -> F:
    """Give a registered reader its kind's duty on a damaged file (docs/reference/files.md says each); a missing
    file is None, an INPUT's a UserError."""
    name = _name_of(fn)
    entry = READERS.get(name)
    if entry is None or entry.duty is not None:
        raise RuntimeError(f"{name} is not a registered reader: add it to llmexp.rundir.readers.READERS")

    @functools.wraps(fn)
    def read(path: Path | str, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(Path(path), *args, **kwargs)
        except FileNotFoundError:
            if entry.kind == INPUT:
                raise UserError(f"{path}: no such file; point the setting at {entry.fix or 'an existing file'}"
                                ) from None
            return None
        except (Damaged, OSError) as err:
            damage = err if isinstance(err, Damaged) else Damaged(path, f"cannot be read ({err.strerror or err})")
        if entry.kind == INPUT:
            fix = f"; it must be {entry.fix}" if entry.fix and entry.fix not in str(damage) else ""  # (once)
            raise UserError(f"{damage}{fix}") from None
        skipped(f"{damage}; {entry.fix}" if entry.kind == CACHE else str(damage),
                logging.INFO if entry.kind == CACHE else logging.WARNING)
        return None

    return read  # type: ignore[return-value]


def entry_of(fn: Callable[..., Any]) -> Reader:
    return READERS[_name_of(fn)]


def _name_of(fn: Callable[..., Any]) -> str:
    """A function's registry name. A module run by `python -m` (a job process: `llmexp.sweep.local`) is named
    `__main__` there; its spec keeps the importable name the registry knows it by."""
    module = fn.__module__
    if module == "__main__" and (spec := getattr(sys.modules["__main__"], "__spec__", None)) is not None:
        module = spec.name
    return f"{module}:{fn.__qualname__}"


def load_json(path: Path, fn: Callable[..., Any], parse: Callable[[str, Path], Any] | None = None) -> Any:
    """The body of a JSON (or, with `parse`, another) file's reader `fn`: the file read within its size, parsed,
    and its fields checked (a record keeps what fits, says what it skipped; an input's or a cache's fits whole)."""
    entry = entry_of(fn)
    value = (parse or parse_json)(read_text(path, entry.max_bytes), path)
    if entry.fields is None:
        return value
    out, problems = check_fields(value, entry.fields, finite=entry.kind != RECORD)
    if problems and (entry.kind != RECORD or out is None):
        raise Damaged(path, f"{problems[0]}{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}")
    if problems:
        skipped(f"fields of {path}: {', '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}")
    return out


def load_yaml(path: Path, fn: Callable[..., Any]) -> Any:
    return load_json(path, fn, parse_yaml)


# ----------------------------------------------------------------------------- bytes and text


NOT_FILES = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device",
             stat.S_IFSOCK: "a socket"}
"""What a path is that is not a regular file: reading one could block (a FIFO) or never end (a device)."""


@contextmanager
def open_regular(path: Path | str) -> Iterator[IO[bytes]]:
    """A regular file opened for reading, never anything that could block or never end: a FIFO opens without
    waiting for a writer (O_NONBLOCK) and is refused, as are directories and devices (a link to /dev/zero)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise Damaged(path, f"it is {NOT_FILES.get(stat.S_IFMT(mode), 'not a regular file')}, not a file")
        yield f


def file_sha256(path: Path | str) -> str:
    """The sha256 of a regular file's bytes (a cache key from user data, a check of a cache entry or checkpoint)."""
    with open_regular(path) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _size(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n / KiB:g} KiB"


def read_bytes(path: Path | str, max_bytes: int | None) -> bytes:
    """A regular file's bytes, at most `max_bytes` (more is damage)."""
    with open_regular(path) as f:
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise Damaged(path, f"it is larger than {_size(max_bytes)}")
    return data


def decode(data: bytes, path: Path | str, line: int | None = None) -> str:
    """UTF-8 text (a UTF-8 byte-order mark allowed); otherwise Damaged naming the line of the first bad byte."""
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise Damaged(path, "it is UTF-16 text, not UTF-8; save it as UTF-8", line)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise Damaged(path, f"it is not UTF-8 text (byte {data[err.start:err.start + 1]!r}); save it as UTF-8",
                      line or data.count(b"\n", 0, err.start) + 1) from None


def read_text(path: Path | str, max_bytes: int | None) -> str:
    return decode(read_bytes(path, max_bytes), path)


def read_lines(path: Path | str, max_line_bytes: int | None) -> Iterator[tuple[int, str | Damaged]]:
    """(line number, text) of each line of a regular file, read one at a time; a line longer than
    `max_line_bytes` or not UTF-8 comes as a Damaged naming it (a record's reader skips it, an input's raises)."""
    limit = -1 if max_line_bytes is None else max_line_bytes + 1
    with open_regular(path) as f:
        for number, raw in enumerate(iter(functools.partial(f.readline, limit), b""), start=1):
            if max_line_bytes is not None and len(raw) > max_line_bytes:
                while raw and not raw.endswith(b"\n"):  # the rest of the line, unread
                    raw = f.readline(limit)
                yield number, Damaged(path, f"the line is longer than {_size(max_line_bytes)}", number)
                continue
            try:
                yield number, decode(raw, path, number)
            except Damaged as err:
                yield number, err


# ----------------------------------------------------------------------------- JSON and YAML


def too_deep(value: Any) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_DEPTH:
                return True
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return False


def parse_json(text: str, path: Path | str, line: int | None = None) -> Any:
    """JSON, or Damaged naming the line: not JSON, nested deeper than MAX_DEPTH, a number longer than Python
    reads (`sys.get_int_max_str_digits`). NaN and Infinity read as floats (a diverged run logs them)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise Damaged(path, f"malformed JSON ({err.msg}, column {err.colno})", line or err.lineno) from None
    except RecursionError:
        raise Damaged(path, f"JSON nested too deeply to parse (over {MAX_DEPTH} levels)", line) from None
    except ValueError:  # an integer of more digits than Python converts
        raise Damaged(path, f"a number of more than {sys.get_int_max_str_digits()} digits, more than Python reads",
                      line) from None
    if text.count("[") + text.count("{") > MAX_DEPTH and too_deep(value):
        raise Damaged(path, f"JSON nested too deeply to parse (over {MAX_DEPTH} levels)", line)
    return value


def parse_yaml(text: str, path: Path | str, load: Callable[[str], Any] | None = None) -> Any:
    """YAML as OmegaConf reads it (YAML 1.2 numbers: `1e-3` is a float; plain data, interpolations as strings), or
    as `load` reads it; Damaged naming the line."""
    import yaml
    from omegaconf import OmegaConf

    try:
        if load is not None:
            value = load(text)
        else:
            value = OmegaConf.to_container(OmegaConf.create(text), resolve=False) if text.strip() else None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        raise Damaged(path, f"not YAML ({err.problem or err.context})", mark.line + 1 if mark else None) from None
    except RecursionError:
        raise Damaged(path, f"YAML nested deeper than {MAX_DEPTH} levels") from None
    except Exception as err:  # an integer longer than Python reads, a key OmegaConf refuses ...
        raise Damaged(path, f"not YAML ({type(err).__name__}: {first_line(err, 120)})") from None
    if too_deep(value):
        raise Damaged(path, f"YAML nested deeper than {MAX_DEPTH} levels")
    return value


# ----------------------------------------------------------------------------- typed fields

_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
               bool: "true or false", type(None): "null"}


def _name(value: Any) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


def check_fields(value: Any, spec: Any, finite: bool = False) -> tuple[Any, list[str]]:
    """`value` with what does not fit `spec` left out, and what was left out. A spec is a type (`float` takes an
    int, never a bool, and NaN or infinity, as a number or `NON_FINITE`'s strings, only unless `finite`; `float |
    None` takes null), `[item]` a list, `{field: spec}` an object whose named fields are checked (others kept; a
    `Need` field must be there), `{str: spec}` an object of any keys. A value that does not fit at all is None."""
    problems: list[str] = []

    def fit(v: Any, s: Any, at: str) -> Any:
        s = s.spec if isinstance(s, Need) else s  # (the object that holds the field checks that it is there)
        shape = type(s) if isinstance(s, list | dict) else None  # `[item]` takes a list, `{field: spec}` an object
        if shape is not None and not isinstance(v, shape):
            problems.append(f"{at or 'the file'} is {_name(v)}, not {_JSON_NAMES[shape]}")
            return _OUT
        if isinstance(s, list):
            items = [fit(x, s[0], f"{at}[{i}]") for i, x in enumerate(v)]
            return [x for x in items if x is not _OUT]
        if isinstance(s, dict):
            if missing := [k for k, f in s.items() if isinstance(f, Need) and k not in v]:
                problems.append(f"{at or 'the file'} has no {missing[0]}")
                return _OUT
            named = {k: s[k] for k in v if k in s} if set(s) != {str} else dict.fromkeys(v, s[str])
            out = {k: fit(x, named[k], f"{at}.{k}" if at else str(k)) if k in named else x for k, x in v.items()}
            if any(out[k] is _OUT for k, f in named.items() if isinstance(f, Need)):
                return _OUT
            return {k: x for k, x in out.items() if x is not _OUT}
        if s is Any:
            return v
        kinds = get_args(s) or (s,)
        if isinstance(v, str) and v in NON_FINITE and float in kinds and not finite:
            return float(v)  # how the metrics logger writes NaN and infinity, which JSON has no word for
        typed = bool in kinds if isinstance(v, bool) else isinstance(v, (*kinds, int) if float in kinds else kinds)
        if typed and not (finite and isinstance(v, float) and not math.isfinite(v)):
            return v
        wanted = " or ".join(_JSON_NAMES.get(k, k.__name__) for k in kinds)
        problems.append(f"{at or 'the file'} is {repr(v) if typed else _name(v)}, not {wanted}")
        return _OUT

    out = fit(value, spec, "")
    return (None if out is _OUT else out), problems


_OUT = object()
NON_FINITE = ("nan", "inf", "-inf")
"""NaN and infinity as `monitor.logger` writes them to metrics.jsonl: strings, which a float field reads back."""


@reader
def read_yaml(path: Path) -> Any:
    """A YAML file Hydra wrote (`.hydra/*.yaml`, `multirun.yaml`), as plain data (interpolations as strings)."""
    return load_yaml(path, read_yaml)
