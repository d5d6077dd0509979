"""`data.streaming=true` (data=hf): the train split read as training goes, never tokenised into the cache (what
it does for the user: docs/how-to/data.md, "Streaming"). `build_stream_datasets` stands in for `build_datasets`,
used as `llmexp.data.datasets`' docstring shows; its `step_indices` are arange(G), the rows of the step's batch.

The stream's order and its resume are that page's: each window's rows are mapped to records with hub.py's columns,
tokenised in one call and cut by `llmexp.data.datasets.cut_examples`. What does not fill a row yet (the packer's
carry-over) goes on into the next window, and into the next epoch. datasets' shuffle buffer is not used: its content
is not part of `state_dict()`, so a resume through it could not be exact. `position(step)` is the `WindowStart` that
step's first example lies in (JSON, in the checkpoint's trainer state). The eval set is held in memory.
"""

from __future__ import annotations

import atexit
import copy
import glob
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import DictConfig

from llmexp.data.cache import hash_obj
from llmexp.data.corpora import check_record, files_signature
from llmexp.data.datasets import (
    FORMAT_VERSION,
    TokenDataset,
    concat_columns,
    cut_examples,
    encode_records,
    example_mode,
    pad_id_of,
)
from llmexp.data.hub import load_split, record_columns, row_records, split_where, to_record, utf8_rows
from llmexp.errors import UserError

if TYPE_CHECKING:
    import torch

STREAM_VERSION = 1
"""Bump when the order or cutting of streamed examples changes: it is part of the data fingerprint."""


@dataclass
class WindowStart:
    """Where the stream stands at a window's first row: enough to continue from there exactly."""

    epoch: int
    window: int
    examples: int
    """Examples the stream produced before this window."""
    source: dict[str, Any] | None = None
    """datasets' `IterableDataset.state_dict()` at this row; None: the epoch's first row."""
    carry: list[list[int]] = field(default_factory=list)
    """Tokens cut but not yet in a finished row, one list per example (text: one run of tokens)."""
    carry_masks: list[list[int]] | None = None
    """The carry-over's target masks (SFT rows); None for text."""


@dataclass
class StreamSpec:
    """What the stream reads and how it cuts: fixed for a run."""

    open_split: Callable[[], Any]
    """A fresh `datasets.IterableDataset` of the train split."""
    columns: dict[str, str]
    mode: str
    tokenizer: Any
    max_length: int
    window: int
    skip_rows: int
    """Rows at the start of every epoch that are the eval set (0 with data.eval_split)."""
    pad_id: int
    where: str


class StreamDataset:
    """The train split as a stream, behind TokenDataset's interface (`step_indices`, `get_batch`,
    `num_targets`, `position`, `restore`). Stateful: `get_batch` and `num_targets` answer for the
    step the last `step_indices` call asked for.

    Every rank reads the whole stream and builds the whole global batch, then keeps its share through
    `micro_batch`, exactly as with the cached data: so micro-batching and world size see the same
    examples at the same step, and no rank has to tell another where the stream is.
    """

    def __init__(self, spec: StreamSpec) -> None:
        self.spec = spec
        self._seed: int | None = None
        self._starts = [WindowStart(0, 0, 0)]
        """Window starts still needed; the last one is where reading continues."""
        self._windows: list[tuple[int, TokenDataset]] = []
        """Rows cut but not yet trained past: (index of the first example, rows)."""
        self._source: Any = None
        self._reader: Iterator[dict[str, Any]] | None = None
        self._epoch_first: tuple[int, int] = (0, 0)
        """(epoch, examples) when the current epoch began: an epoch that adds nothing is an error."""
        self._step = TokenDataset(np.empty(0, np.int64), np.zeros(1, np.int64), None, None,
                                  np.empty(0, np.int64), spec.pad_id)
        atexit.register(self.close)

    def __len__(self) -> int:
        return 0  # unknown until the stream ends; the trainer needs train.max_steps (validated)

    def step_indices(self, seed: int, step: int, global_batch_size: int) -> np.ndarray:
        """Rows 0..G-1 of the step's batch: examples [step*G, (step+1)*G) of the stream, read as needed."""
        lo, hi = step * global_batch_size, (step + 1) * global_batch_size
        if self._seed is not None and seed != self._seed:
            self._reset(WindowStart(0, 0, 0))  # another seed is another order: start over
        self._seed = seed
        self._rewind(lo)
        while self._starts[-1].examples < hi:
            self._read_window()
        self._step = self._examples(lo, hi)
        self._forget_before(lo)
        return np.arange(global_batch_size, dtype=np.int64)

    def num_targets(self, indices: np.ndarray) -> int:
        return self._step.num_targets(indices)

    def get_batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        return self._step.get_batch(indices)

    def position(self, step: int, global_batch_size: int) -> dict[str, Any]:
        """The window start that step `step`'s first example lies in, as JSON-able data for a checkpoint."""
        return copy.deepcopy(asdict(self._start_at(step * global_batch_size)))

    def restore(self, position: dict[str, Any]) -> None:
        """Continue from a checkpoint's `position` (an empty one: from the start)."""
        self._reset(WindowStart(**copy.deepcopy(position)) if position else WindowStart(0, 0, 0))

    def close(self) -> None:
        """Close the open reader now: one left to the interpreter's exit finds pyarrow torn down and
        prints a warning from inside datasets."""
        if self._reader is not None and hasattr(self._reader, "close"):
            self._reader.close()
        self._reader = self._source = None

    def _reset(self, start: WindowStart) -> None:
        self.close()
        self._starts, self._windows = [start], []

    def _start_at(self, example: int) -> WindowStart:
        """The last known window start at or before `example` (the split's start when none is known)."""
        return max((s for s in self._starts if s.examples <= example), key=lambda s: s.examples,
                   default=WindowStart(0, 0, 0))

    def _rewind(self, lo: int) -> None:
        """Go back to the window start at or before example `lo` when what is kept begins after it."""
        kept = self._windows[0][0] if self._windows else self._starts[-1].examples
        if kept > lo:
            self._reset(self._start_at(lo))

    def _read_window(self) -> None:
        start = self._starts[-1]
        with utf8_rows(self.spec.where):
            rows = self._rows(start)
        if not rows:  # the split ended: the next epoch begins, the carry-over goes on
            self._next_epoch(start)
            return
        order = np.random.default_rng([self._seed % 2**64, start.epoch, start.window]).permutation(len(rows))
        first = self.spec.skip_rows + start.window * self.spec.window  # the window's first row in the split
        recs = [check_record(to_record(rows[i], self.spec.columns), f"{self.spec.where}: row {first + i} (epoch "
                             f"{start.epoch})") for i in order]
        ids, masks = encode_records(self.spec.mode, recs, self.spec.tokenizer)
        ids = [np.asarray(c, np.int64) for c in start.carry] + ids
        if masks is not None:
            masks = [np.asarray(m, bool) for m in start.carry_masks or []] + masks
        arrays, _ = cut_examples(self.spec.mode, ids, masks, self.spec.max_length, keep_tail=False)
        done, carry, carry_masks = self._split_carry(arrays, ids)
        self._windows.append((start.examples, done))
        self._starts.append(WindowStart(start.epoch, start.window + 1, start.examples + len(done),
                                        copy.deepcopy(self._source.state_dict()), carry, carry_masks))

    def _rows(self, start: WindowStart) -> list[dict[str, Any]]:
        """The next window's rows (fewer at the end of the split, none after it)."""
        if self._reader is None:
            self._source = self.spec.open_split()
            if start.source is not None:
                self._source.load_state_dict(copy.deepcopy(start.source))
            self._reader = iter(self._source)
            if start.source is None:  # an epoch's first rows: the eval set is never trained on
                self._epoch_first = (start.epoch, start.examples)
                next(itertools.islice(self._reader, self.spec.skip_rows, self.spec.skip_rows), None)
        return list(itertools.islice(self._reader, self.spec.window))

    def _next_epoch(self, end: WindowStart) -> None:
        if self._epoch_first == (end.epoch, end.examples) and (end.window == 0 or self.spec.mode != "lm_packed"):
            why = "no rows besides the eval rows" if end.window == 0 else "no row kept a target token"
            raise UserError(f"{self.spec.where}: a whole epoch of the stream gave no training example ({why}); "
                            "add data, lower data.stream_eval_rows, set data.eval_split, or raise data.max_length")
        self._starts[-1] = WindowStart(end.epoch + 1, 0, end.examples, None, end.carry, end.carry_masks)
        self.close()

    def _split_carry(self, arrays: dict[str, np.ndarray], ids: list[np.ndarray]
                     ) -> tuple[TokenDataset, list[list[int]], list[list[int]] | None]:
        """The finished rows, and what goes on into the next window: a text block's unfilled tail, or the
        examples of the last packed SFT row (more may still fit beside them)."""
        offsets = arrays["offsets"]
        rows, carry, carry_masks = len(offsets) - 1, [], None
        if self.spec.mode == "lm_packed":
            tail = np.concatenate(ids)[int(offsets[-1]):] if ids else np.empty(0, np.int64)
            carry = [tail.tolist()] if len(tail) else []
        elif self.spec.mode == "sft_packed" and rows:
            a = int(offsets[-2])
            cuts = np.flatnonzero(arrays["positions"][a:] == 0)[1:]
            carry = [x.tolist() for x in np.split(arrays["ids"][a:], cuts)]
            carry_masks = [x.astype(int).tolist() for x in np.split(arrays["mask"][a:], cuts)]
            rows -= 1
        return _dataset(_rows(arrays, 0, rows), self.spec.pad_id), carry, carry_masks

    def _examples(self, lo: int, hi: int) -> TokenDataset:
        """Examples [lo, hi) of the kept windows, in order, as one TokenDataset (a step's global batch)."""
        spans = [(vars(ds), max(lo, first) - first, min(hi, first + len(ds)) - first) for first, ds in self._windows]
        return _dataset(concat_columns([_rows(arrays, a, b) for arrays, a, b in spans if a < b]), self.spec.pad_id)

    def _forget_before(self, lo: int) -> None:
        """Drop rows and window starts that no step from `lo` on can need."""
        self._windows = [(f, r) for f, r in self._windows if f + len(r) > lo]
        self._starts = [s for s, after in zip(self._starts, [*self._starts[1:], None], strict=True)
                        if after is None or after.examples > lo]


def _rows(arrays: dict[str, Any], a: int, b: int) -> dict[str, np.ndarray]:
    """Rows [a, b) of `cut_examples`' arrays (or of a TokenDataset's `vars`), their offsets counted from 0."""
    lo, hi = int(arrays["offsets"][a]), int(arrays["offsets"][b])
    out = {name: arrays[name][lo:hi] for name in ("ids", "mask", "positions") if arrays.get(name) is not None}
    return {**out, "offsets": arrays["offsets"][a:b + 1] - lo, "row_targets": arrays["row_targets"][a:b]}


def _dataset(arrays: dict[str, np.ndarray], pad_id: int) -> TokenDataset:
    return TokenDataset(arrays["ids"], arrays["offsets"], arrays.get("mask"), arrays.get("positions"),
                        arrays["row_targets"], pad_id)


def _open(d: Any, split: str) -> tuple[Any, dict[str, str], str]:
    """A split as a stream, hub.py's column mapping for it, and its name in messages; a stream without
    declared features shows its columns in its first row."""
    where, source = split_where(d, split), load_split(d, split, streaming=True)
    names = source.column_names
    if names is None:
        first = next(iter(source), None)
        if first is None:
            raise UserError(f"{where} is empty; add rows or point data.path elsewhere")
        names = list(first)
    return source, record_columns(d, list(names)), where


def _eval_dataset(d: Any, mode: str, tok: Any, max_length: int, pad_id: int) -> tuple[TokenDataset, dict[str, int]]:
    """The eval set, in memory: data.eval_split, else the split's first data.stream_eval_rows rows."""
    source, columns, where = _open(d, d.eval_split or d.split)
    rows = iter(source) if d.eval_split else itertools.islice(iter(source), int(d.stream_eval_rows))
    recs = row_records(rows, columns, where)
    if not d.eval_split and len(recs) < int(d.stream_eval_rows):  # found now, not at the first step
        raise UserError(f"{where} has {len(recs)} row(s), and data.stream_eval_rows={d.stream_eval_rows} holds "
                        "out that many for eval: nothing would be left to train on. Lower data.stream_eval_rows "
                        "or set data.eval_split")
    arrays, stats = cut_examples(mode, *encode_records(mode, recs, tok), max_length, keep_tail=True)
    if stats["examples"] == 0:
        held = f"data.eval_split={d.eval_split}" if d.eval_split else f"data.stream_eval_rows={d.stream_eval_rows}"
        raise UserError(f"{where}: the eval set ({held}) has no usable records: {len(recs)} row(s); raise "
                        "data.stream_eval_rows, set data.eval_split, or raise data.max_length")
    return _dataset(arrays, pad_id), stats


def _local_files(d: Any) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of the local files the stream reads: a cheap fingerprint, where hashing the
    content of a corpus larger than the disk cache would mean reading it all."""
    patterns = [str(Path(str(d.path)).expanduser())]
    files = d.data_files
    if files is not None:
        values = files.values() if hasattr(files, "values") else [files]
        patterns += [str(p) for v in values for p in ([v] if isinstance(v, str) else v)]
    found = {Path(p) for pattern in patterns for p in glob.glob(str(Path(pattern).expanduser()), recursive=True)}
    paths = sorted(q for p in found for q in ([p] if p.is_file() else p.rglob("*")) if q.is_file())
    return files_signature(Path(), [str(p) for p in paths])


def stream_fingerprint(cfg: DictConfig, tok: Any) -> str:
    """The data key of a streamed run (checkpoints compare it on resume): source, settings, tokenizer."""
    from llmexp.data.tokenizer import tokenizer_fingerprint

    d = cfg.data
    keys = ("name", "path", "config_name", "split", "eval_split", "text_field", "prompt_field", "completion_field",
            "messages_field", "max_length", "packing", "shuffle_window", "stream_eval_rows")
    return hash_obj({"format": FORMAT_VERSION, "stream": STREAM_VERSION, **{k: d[k] for k in keys},
                     "data_files": str(d.data_files), "files": _local_files(d),
                     "tokenizer": tokenizer_fingerprint(tok)})


def build_stream_datasets(cfg: DictConfig, tok: Any) -> tuple[StreamDataset, TokenDataset, dict[str, Any]]:
    """The streamed train split, the in-memory eval set, and their stats (for summary.json)."""
    began = time.perf_counter()
    d = cfg.data
    _, columns, where = _open(d, d.split)
    mode = example_mode(cfg, "text" not in columns)
    pad_id = pad_id_of(tok)
    held, eval_stats = _eval_dataset(d, mode, tok, int(d.max_length), pad_id)
    spec = StreamSpec(lambda: load_split(d, d.split, streaming=True), columns, mode, tok, int(d.max_length),
                      int(d.shuffle_window), 0 if d.eval_split else int(d.stream_eval_rows), pad_id, where)
    stats = {"data_mode": mode, "data_streaming": True, "data_cache_hit": False,
             "data_cache_key": stream_fingerprint(cfg, tok), **{f"data_eval_{k}": v for k, v in eval_stats.items()}}
    return StreamDataset(spec), held, {**stats, "data_prep_s": round(time.perf_counter() - began, 3)}
