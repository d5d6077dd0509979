"""Where text comes from: the standard library, JSON/JSONL records and plain text files.

Everything here is plain Python (no torch, no tokenizer). A corpus is a list of records, each
a dict with exactly one shape: `{"text"}`, `{"prompt", "completion"}` or `{"messages"}`.
Bad input raises `UserError` naming the file, line or record and what was expected.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import io
import itertools
import json
import os
import sys
import sysconfig
import tokenize
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmexp.errors import UserError
from llmexp.machine.paths import text_source_files
from llmexp.rundir import readers
from llmexp.rundir.readers import Damaged, entry_of, file_sha256, parse_json, reader

Record = dict[str, Any]

STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
"""Directory names skipped anywhere under the stdlib (test suites, installed packages, bytecode)."""
KNOWN_FIELDS = "`text`, `prompt` + `completion`, or `messages` (a list of {role, content})"
ROLES = ("system", "user", "assistant")
SFT_RECIPE_VERSION = 1
"""Bump when the stdlib_sft pairs change, so their cached tokens are rebuilt."""


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative paths of the stdlib's .py files, tests and site-packages excluded, sorted."""
    root = root or stdlib_root()
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS and not d.startswith("config-"))
        rel_dir = os.path.relpath(dirpath, root)
        found += [os.path.normpath(os.path.join(rel_dir, f)) for f in filenames if f.endswith(".py")]
    return sorted(found)


def files_signature(root: Path, rel_paths: Iterable[str]) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) per file: a cheap fingerprint for files that only change on upgrade."""
    return [(rel, (st := os.stat(root / rel)).st_size, st.st_mtime_ns) for rel in rel_paths]


def hash_fraction(text: str) -> float:
    """A stable number in [0, 1) from a string (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def split_by_hash(names: list[str], eval_fraction: float) -> tuple[list[str], list[str]]:
    """Deterministic train/eval split by name; eval is never empty when there are 2+ names."""
    scores = {name: hash_fraction(name) for name in names}
    eval_names = [n for n in names if scores[n] < eval_fraction]
    if not eval_names and len(names) >= 2:
        eval_names = [min(names, key=scores.__getitem__)]
    held = set(eval_names)
    return [n for n in names if n not in held], eval_names


@reader
def read_text(path: Path) -> str:
    """A user's text file (data=text): UTF-8, or exit 2 naming the line of the first byte that is not."""
    return readers.read_text(path, entry_of(read_text).max_bytes)


@reader
def read_source(path: Path) -> str:
    """A Python source file of the stdlib corpus, decoded as Python decodes it (PEP 263: UTF-8 unless it says)."""
    data = readers.read_bytes(path, entry_of(read_source).max_bytes)
    try:
        return data.decode(tokenize.detect_encoding(io.BytesIO(data).readline)[0])
    except (SyntaxError, UnicodeDecodeError, LookupError) as err:
        raise Damaged(path, f"not Python source ({err})") from None


def require_file(path_str: str | None, key: str) -> Path:
    """The path as an existing, non-empty file, or a UserError naming the key."""
    if not path_str:
        raise UserError(f"{key} is not set; set {key}=path/to/file")
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise UserError(f"{key}={path_str}: no such file (resolved to {path.resolve()})")
    if path.stat().st_size == 0 or not read_text(path).strip():
        raise UserError(f"{key}={path_str}: the file is empty")
    return path


def text_files(spec: str | None, key: str) -> list[Path]:
    """A file, a directory (every file under it, recursively, but hidden ones) or a glob, as sorted files."""
    if not spec:
        raise UserError(f"{key} is not set; set {key}=path/to/file_dir_or_glob")
    if not Path(spec).expanduser().is_dir() and not any(ch in spec for ch in "*?["):
        return [require_file(spec, key)]
    files = text_source_files(spec)
    if not files:
        raise UserError(f"{key}={spec}: matches no non-empty files")
    return files


def check_record(rec: Any, where: str) -> Record:
    """Validate one record's shape; return it reduced to its known fields."""
    if not isinstance(rec, dict):
        raise UserError(f"{where}: a record must be a JSON object with {KNOWN_FIELDS}; got {type(rec).__name__}")
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise UserError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects")
        for j, m in enumerate(msgs):
            if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                raise UserError(f"{where}: messages[{j}] must be {{\"role\": one of {', '.join(ROLES)}, "
                                f"\"content\": string}}; got {json.dumps(m)[:120]}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise UserError(f"{where}: `messages` has no assistant turn, so nothing to learn from")
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in msgs]}
    if "prompt" in rec or "completion" in rec:
        for field in ("prompt", "completion"):
            if not isinstance(rec.get(field), str):
                raise UserError(f"{where}: `prompt` + `completion` records need both as strings; `{field}` is "
                                f"{'missing' if field not in rec else type(rec[field]).__name__}")
        return {"prompt": rec["prompt"], "completion": rec["completion"]}
    if "text" in rec:
        if not isinstance(rec["text"], str):
            raise UserError(f"{where}: `text` must be a string, got {type(rec['text']).__name__}")
        return {"text": rec["text"]}
    found = ", ".join(sorted(map(str, rec))) or "none"
    raise UserError(f"{where}: the record has none of the known fields; expected {KNOWN_FIELDS} (found: {found})")


@reader
def read_json_records(path: Path) -> list[Record]:
    """Records of a JSON list or a JSONL file, validated; errors name the file and line."""
    text = readers.read_text(path, entry_of(read_json_records).max_bytes)
    if text.lstrip().startswith("["):
        return [check_record(rec, f"{path}: record {i}") for i, rec in enumerate(parse_json(text, path))]
    # "\n" only: str.splitlines also breaks at U+2028, U+2029 and U+0085, which JSON strings may hold raw
    lines = [(lineno, line) for lineno, line in enumerate(text.split("\n"), start=1) if line.strip()]
    return [check_record(parse_json(line, path, n), f"{path}:{n}: record {i}") for i, (n, line) in enumerate(lines)]


def split_records(records: list[Any], eval_fraction: float,
                  content: Callable[[Any], str] = lambda r: json.dumps(r, sort_keys=True)) -> tuple[list, list]:
    """Hold out records by a hash of their content: stable under reordering, and under adding records (a record's
    side is its own; the n-th copy of a duplicate is told apart by n, not by its position)."""
    copies: dict[str, int] = {}
    by_key = {}
    for r in records:
        text = content(r)
        copies[text] = copies.get(text, -1) + 1
        by_key[f"{copies[text]}:{text}"] = r
    train_keys, eval_keys = split_by_hash(list(by_key), eval_fraction)
    return [by_key[k] for k in train_keys], [by_key[k] for k in eval_keys]


def split_text(texts: list[str], eval_fraction: float) -> tuple[list[str], list[str]]:
    """One document: its last `eval_fraction` of lines is the eval set. Several: a split by content hash."""
    if len(texts) == 1:
        lines = texts[0].splitlines(keepends=True)
        cut = min(max(1, int(len(lines) * (1 - eval_fraction))), len(lines) - 1)
        if cut < 1:
            raise UserError("a single one-line text file cannot be split into train and eval; "
                            "set data.eval_file or give more text")
        return ["".join(lines[:cut])], ["".join(lines[cut:])]
    return split_records(texts, eval_fraction, content=str)


def _docstring_pairs(root: str, rel: str) -> list[Record]:
    """signature -> docstring pairs of one module's public functions and methods."""
    try:
        tree = ast.parse(read_source(Path(root) / rel))
    except (SyntaxError, ValueError):
        return []
    pairs: list[Record] = []

    def visit(node: ast.AST, owner: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{owner}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(child)
                if doc and not child.name.startswith("_") and len(doc) >= 20:
                    doc = inspect.cleandoc(doc).split("\n\n")[0][:400]
                    kw = "async def" if isinstance(child, ast.AsyncFunctionDef) else "def"
                    ret = f" -> {ast.unparse(child.returns)}" if child.returns else ""
                    prompt = f"# {rel}: {owner}{child.name}\n{kw} {child.name}({ast.unparse(child.args)}){ret}:\n"
                    body = "\n".join("    " + ln if ln else "" for ln in doc.splitlines())
                    pairs.append({"prompt": prompt + '    """', "completion": body.lstrip() + '\n    """\n'})

    visit(tree, "")
    return pairs


def stdlib_sft_records(rel_paths: list[str], num_proc: int, max_examples: int | None = None) -> list[Record]:
    """Instruction pairs from the stdlib: a function's signature is the prompt, its docstring's first
    paragraph (at most 400 characters) the completion. Parsing runs on `num_proc` processes; with `max_examples`,
    the first that many pairs of the files in hash order, parsing only what is needed (in this process)."""
    root = str(stdlib_root())
    if max_examples is not None:
        pairs = (pair for rel in sorted(rel_paths, key=hash_fraction) for pair in _docstring_pairs(root, rel))
        return list(itertools.islice(pairs, max_examples))
    if num_proc > 1 and len(rel_paths) > 50:
        with ProcessPoolExecutor(num_proc) as pool:
            chunks = list(pool.map(_docstring_pairs, [root] * len(rel_paths), rel_paths, chunksize=16))
    else:
        chunks = [_docstring_pairs(root, rel) for rel in rel_paths]
    return [pair for chunk in chunks for pair in chunk]


@dataclass
class Corpus:
    """A corpus's identity (cheap to compute, keys the caches) and how to read it (only on a miss)."""

    name: str
    fingerprint: dict[str, Any]
    """Identifies the train and eval content and how it is split."""
    bpe_fingerprint: dict[str, Any]
    """Identifies the text a BPE tokenizer would be trained on (the train split)."""
    load: Callable[[], tuple[list[Record], list[Record]]]
    """Read, validate and split: (train records, eval records)."""
    bpe_texts: Callable[[], Iterator[str]]
    """The train split's text, for training a tokenizer."""


PLAIN_ROLE_HEADERS = {"system": "### System:\n", "user": "### User:\n", "assistant": "### Assistant:\n"}
"""The plain chat template, for tokenizers without one (docs/how-to/data.md, "Records, length and packing")."""


def plain_text(rec: Record) -> str:
    """A record as plain text (for tokenizer training): the plain chat template without special tokens."""
    if "text" in rec:
        return rec["text"]
    if "prompt" in rec:
        return rec["prompt"] + rec["completion"]
    return "".join(f"{PLAIN_ROLE_HEADERS[m['role']]}{m['content']}\n\n" for m in rec["messages"])


def stdlib_corpus(d: Any) -> Corpus:
    root = stdlib_root()
    train, held = split_by_hash(stdlib_files(root), float(d.eval_fraction))
    if d.name == "stdlib" and d.max_examples is not None:  # a hash-ordered (so unbiased, yet stable) subset
        keep = set(sorted(train, key=hash_fraction)[: int(d.max_examples)])
        train = [rel for rel in train if rel in keep]
    base = {"root": str(root), "version": sys.version, "eval_fraction": d.eval_fraction}
    fp = {**base, "kind": d.name, "train": files_signature(root, train), "eval": files_signature(root, held)}
    if d.name == "stdlib_sft":
        fp.update(max_examples=d.max_examples, recipe=SFT_RECIPE_VERSION)

    def load() -> tuple[list[Record], list[Record]]:
        if d.name == "stdlib":
            return ([{"text": read_source(root / r)} for r in train], [{"text": read_source(root / r)} for r in held])
        return stdlib_sft_records(train, int(d.num_proc), d.max_examples), stdlib_sft_records(held, int(d.num_proc))

    # stdlib_sft shares the stdlib tokenizer: both are trained on the stdlib's train files
    return Corpus(d.name, fp, {**base, "kind": "stdlib", "train": files_signature(root, train)}, load,
                  lambda: (read_source(root / r) for r in train))


def user_corpus(d: Any) -> Corpus:
    def files(spec: str, key: str) -> list[Path]:
        return text_files(spec, key) if d.name == "text" else [require_file(spec, key)]

    train_files = files(d.train_file, "data.train_file")
    eval_files = files(d.eval_file, "data.eval_file") if d.eval_file else []
    fp = {"kind": d.name, "train": [file_sha256(f) for f in train_files], "eval": [file_sha256(f) for f in eval_files],
          "eval_fraction": None if eval_files else d.eval_fraction, "max_examples": d.max_examples}

    def read(files: list[Path]) -> list[Record]:
        return [rec for f in files for rec in ([{"text": read_text(f)}] if d.name == "text" else read_json_records(f))]

    def load() -> tuple[list[Record], list[Record]]:
        train = read(train_files)
        held = read(eval_files) if eval_files else None
        if held is None and d.name == "text":  # text is held out by lines or files, not by records
            texts, held_texts = split_text([r["text"] for r in train], float(d.eval_fraction))
            train, held = [{"text": t} for t in texts], [{"text": t} for t in held_texts]
        return hold_out(train, held, d, lambda n: f"data.train_file={d.train_file} has {n} record(s); cannot hold "
                        "out an eval set. Add records or set data.eval_file")

    return records_corpus(d.name, fp, load)


def hold_out(train: list[Record], held: list[Record] | None, d: Any,
             too_few: Callable[[int], str]) -> tuple[list[Record], list[Record]]:
    """A corpus's (train, eval) records: `held` when it has its own eval set, else `data.eval_fraction` of
    the training records held out by content hash (`too_few(n)` is the error for fewer than two); the
    training records are then cut to `data.max_examples`."""
    if held is None:
        if len(train) < 2:
            raise UserError(too_few(len(train)))
        train, held = split_records(train, float(d.eval_fraction))
    if d.max_examples is not None:
        train = train[: int(d.max_examples)]
    return train, held


def records_corpus(name: str, fingerprint: dict[str, Any], load: Callable[[], tuple[list[Record], list[Record]]]
                   ) -> Corpus:
    """A corpus whose tokenizer is trained on its training records as plain text: its BPE fingerprint is its
    fingerprint without the eval set's."""
    bpe_fingerprint = {k: v for k, v in fingerprint.items() if k != "eval"}
    return Corpus(name, fingerprint, bpe_fingerprint, load, lambda: (plain_text(r) for r in load()[0]))
