"""`data=hf`: anything the `datasets` library loads, its columns turned into llmexp's records (the user's side:
docs/how-to/data.md, "Hub datasets"). The token cache is keyed by the dataset's own fingerprint (datasets computes
one per loaded table), so a changed dataset is tokenised again.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import urllib.parse
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from llmexp.data.corpora import Corpus, Record, check_record, hold_out, records_corpus
from llmexp.errors import UserError
from llmexp.machine.paths import HF_BUILDERS

ALPACA = ("instruction", "input", "output")
SOURCE_KEY = "source_key"
"""A field `sources.mix_source` adds to a mixture's source node: the key its messages name (`data.mix[i]`)."""


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub answers a TCP connect: checked once, so an offline machine fails in seconds
    instead of minutes of retries inside `from_pretrained`."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or ""
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def load_split(d: Any, split: str, streaming: bool = False) -> Any:
    """One split as a `datasets.Dataset` (memory-mapped arrow), or with `streaming` as a
    `datasets.IterableDataset` read as it is iterated; else a UserError that says how to fix it."""
    import datasets

    datasets.disable_progress_bars()
    path, k = str(d.path), key_of(d)
    if path in HF_BUILDERS and not d.data_files:
        raise UserError(f"{k}.path={path} reads files: set {k}.data_files=/path/to/*.{path}")
    local = Path(path).expanduser()
    try:
        if local.is_dir() and ((local / "dataset_info.json").exists() or (local / "dataset_dict.json").exists()):
            table = _split_of(datasets.load_from_disk(str(local)), split, path, k)
            return table.to_iterable_dataset() if streaming else table
        if not (path in HF_BUILDERS or local.exists()) and not hub_reachable():
            datasets.config.HF_HUB_OFFLINE = True  # read the local cache only, and fail at once when it is not there
        # a list or a {split: files} mapping as datasets takes them (a ListConfig/DictConfig is neither)
        files = OmegaConf.to_container(d.data_files) if OmegaConf.is_config(d.data_files) else d.data_files
        return datasets.load_dataset(path, name=d.config_name, data_files=files, split=split, streaming=streaming)
    except UserError:
        raise
    except Exception as err:  # whatever `datasets` raises on a dataset it cannot read is about the data
        raise UserError(_load_error(path, err, k)) from None


def key_of(d: Any) -> str:
    """How messages name a source's keys: `data`, or `data.mix[i]` for a mixture's source (`SOURCE_KEY`)."""
    return str(d[SOURCE_KEY]) if SOURCE_KEY in d else "data"


def split_where(d: Any, split: str) -> str:
    """How messages name a split: `json [train] (data.data_files=a.jsonl)`, the files it reads where they are named."""
    files = f" ({key_of(d)}.data_files={d.data_files})" if d.data_files else ""
    return f"{d.path} [{split}]{files}"


def _load_error(path: str, err: BaseException, k: str) -> str:
    """One line for a dataset `datasets` could not load: the root cause (a DatasetGenerationError wraps the
    parser's error), and the fix: a loading script's, or where to put the data."""
    root = err
    while root.__cause__ is not None:  # `raise ... from`: the parser's own error, not what it tried before
        root = root.__cause__
    first = next((line for e in (root, err) for line in str(e).strip().splitlines()), type(root).__name__)[:300]
    if "scripts are no longer supported" in str(err) or "loading script" in str(err):
        return (f"{k}.path={path} needs a dataset loading script (code), which neither datasets 4 nor llmexp runs "
                f"({first}); convert it to files where you trust the script (datasets.load_dataset(...)"
                f".to_parquet(FILE)), then set {k}.path=parquet {k}.data_files=FILE")
    if "Unknown split" in first:  # the split is the fault, not the files' format
        return (f"{k}.split / {k}.eval_split: {path} has no such split ({first}); a file builder's files are its "
                f"train split: leave {k}.eval_split null (the eval set is then held out), or give {k}.data_files "
                "as {train: FILES, test: FILES}")
    if "corresponds to no data" in first:  # read fine, but no row: not a format problem
        return f"{k}.path={path}: the split has no rows ({first}); add rows to its files, or point {k}.data_files " \
               "at others"
    if path in HF_BUILDERS:  # local files: the hub is not the problem
        return (f"{k}.path={path}: cannot read {k}.data_files as {path} ({type(root).__name__}: {first}); point "
                f"{k}.data_files at {path} files, or set {k}.path to their format ({', '.join(HF_BUILDERS)})")
    return (f"{k}.path={path}: cannot load it ({type(root).__name__}: {first}). Offline, a hub dataset must be in the "
            "local HF cache; otherwise save it where the hub is reachable with "
            f"`datasets.load_dataset(...).save_to_disk(DIR)`, copy DIR here and set {k}.path=DIR, "
            f"or point {k}.path=parquet|json|csv at files with {k}.data_files=...")


def _split_of(loaded: Any, split: str, path: str, k: str) -> Any:
    """A split of a `save_to_disk` directory: a DatasetDict's by name; a lone Dataset is the `train` split."""
    splits = list(loaded.keys()) if hasattr(loaded, "keys") else ["train"]
    if split not in splits:
        raise UserError(f"{k}.split / {k}.eval_split: {path} has no split {split!r}; it has {', '.join(splits)}")
    return loaded[split] if hasattr(loaded, "keys") else loaded


def record_columns(d: Any, names: list[str]) -> dict[str, str]:
    """Which column gives which record field; a named column that is missing is a UserError."""
    chosen = {k: v for k, v in (("text", d.text_field), ("prompt", d.prompt_field),
                                ("completion", d.completion_field), ("messages", d.messages_field)) if v}
    for field, column in chosen.items():
        if column not in names:
            raise UserError(f"{key_of(d)}.{field}_field={column}: no such column; the dataset has {', '.join(names)}")
    if chosen:
        return chosen
    for shape in (("messages",), ("prompt", "completion"), ("text",)):
        if all(c in names for c in shape):
            return {c: c for c in shape}
    if all(c in names for c in ALPACA):
        return {"alpaca": "alpaca"}
    k = key_of(d)
    raise UserError(f"{k}.path={d.path}: no column to train on among {', '.join(names)}; name one with "
                    f"{k}.text_field, {k}.prompt_field + {k}.completion_field, or {k}.messages_field")


def to_record(row: dict[str, Any], columns: dict[str, str]) -> Record:
    """One row as an llmexp record, through the mapping `record_columns` chose."""
    if "alpaca" in columns:  # Alpaca: the instruction, then the input when there is one
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        return {"prompt": f"{prompt}\n\n", "completion": row["output"]}
    return {field: row[column] for field, column in columns.items()}


def row_records(rows: Iterable[dict[str, Any]], columns: dict[str, str], where: str) -> list[Record]:
    """Rows as checked llmexp records; a bad one is named by `where` and its index."""
    return [check_record(to_record(row, columns), f"{where}: row {i}") for i, row in enumerate(rows)]


def _records(ds: Any, d: Any, where: str) -> list[Record]:
    with utf8_rows(where):
        return row_records(ds, record_columns(d, list(ds.column_names)), where)


@contextlib.contextmanager
def utf8_rows(where: str) -> Iterator[None]:
    """Rows that `datasets` decodes as they are read: a file that is not UTF-8 text fails there, named here."""
    try:
        yield
    except UnicodeDecodeError as err:
        raise UserError(f"{where}: a data file is not UTF-8 text (byte {err.object[err.start:err.start + 1]!r}); "
                        "save it as UTF-8") from None


def hf_corpus(d: Any) -> Corpus:
    """The `hf` corpus of a `data` config node: fingerprinted by datasets, read only on a cache miss."""
    train_ds = load_split(d, d.split)
    eval_ds = load_split(d, d.eval_split) if d.eval_split else None
    fields = {k: d[k] for k in ("text_field", "prompt_field", "completion_field", "messages_field")}
    fp = {"kind": "hf", "train": train_ds._fingerprint, "eval": eval_ds._fingerprint if eval_ds else None,
          "eval_fraction": None if eval_ds else d.eval_fraction, "max_examples": d.max_examples, **fields}

    def load() -> tuple[list[Record], list[Record]]:
        train = _records(train_ds, d, split_where(d, d.split))
        held = _records(eval_ds, d, split_where(d, d.eval_split)) if eval_ds is not None else None
        return hold_out(train, held, d, lambda n: f"{key_of(d)}.path={d.path} has {n} row(s); cannot hold out an "
                        f"eval set: add rows or set {key_of(d)}.eval_split")

    return records_corpus("hf", fp, load)
