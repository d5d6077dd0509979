"""Data for the trainer: tokenised, cut into examples, cached, and sampled deterministically.

    tokenizer = load_tokenizer(cfg)                      # llmexp.data.tokenizer
    train, eval, stats = build_datasets(cfg, tokenizer)  # cached under data.cache_dir
    idx = train.step_indices(seed, step, global_batch)  # batch_indices(seed, step, global_batch, len(train))
    batch = train.get_batch(micro_batch(idx, rank, world, micro, micro_batch_size))

Examples are cut one of three ways (`MODES`, chosen from the records and `data.packing` by `example_mode`), and
the token arrays cached under `tokens/<key>/`: docs/explanation/gpu-path.md ("Attention and the mask") and
docs/how-to/data.md ("Records, length and packing", "Tokenizer and cache") say what each way and the cache are.
With `data.streaming=true` the trainer builds from `llmexp.data.stream`, which cuts as it reads and caches nothing.
"""

from __future__ import annotations

import functools
import itertools
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from llmexp.config.derived import mix_quotas
from llmexp.data.cache import cached, hash_obj, save_array
from llmexp.data.corpora import Record
from llmexp.data.sources import load_corpora
from llmexp.errors import UserError

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100
FORMAT_VERSION = 2
"""Bump when the cached arrays' layout or meaning changes (2: json/text records held out by content alone)."""


# ---------------------------------------------------------------- sampler


@functools.lru_cache(maxsize=16)  # this epoch's and the next one's, of each mixture source
def _permutation(seed: int, epoch: int, num_examples: int, stream: int = 0) -> np.ndarray:
    key = [seed % 2**64, epoch] + ([stream] if stream else [])  # stream 0: the unmixed sampler's own key
    perm = np.random.default_rng(key).permutation(num_examples)
    perm.flags.writeable = False
    return perm


def batch_indices(seed: int, step: int, global_batch_size: int, num_examples: int) -> np.ndarray:
    """The example indices of the global batch at optimizer step `step` (0-based): positions step * G + i of
    `_stream_positions`' stream, a pure function of the arguments (docs/how-to/data.md: "The sampler is stateless")."""
    if num_examples <= 0:
        raise ValueError("batch_indices needs at least one example")
    positions = step * global_batch_size + np.arange(global_batch_size, dtype=np.int64)
    return _stream_positions(seed, positions, num_examples)


def _stream_positions(seed: int, positions: np.ndarray, num_examples: int, stream: int = 0) -> np.ndarray:
    """Examples at `positions` of an endless stream made of one fresh permutation per epoch."""
    epochs = positions // num_examples
    out = np.empty(len(positions), dtype=np.int64)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        out[sel] = _permutation(seed, int(epoch), num_examples, stream)[positions[sel] % num_examples]
    return out


@functools.lru_cache(maxsize=4)
def _round_order(seed: int, round_index: int, quotas: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """One round of a mixture: each slot's source (every quota met, in a seeded random order) and,
    per slot, how many slots of the same source precede it in the round."""
    order = np.random.default_rng([seed % 2**64, 2**32 + round_index]).permutation(
        np.repeat(np.arange(len(quotas)), quotas))
    occurrence = np.empty(len(order), dtype=np.int64)
    for source in range(len(quotas)):
        slots = np.flatnonzero(order == source)
        occurrence[slots] = np.arange(len(slots))
    return order, occurrence


def mix_indices(seed: int, step: int, global_batch_size: int, quotas: tuple[int, ...],
                boundaries: np.ndarray) -> np.ndarray:
    """The example indices of a mixture's global batch at step `step` (0-based); source s owns the
    examples [boundaries[s], boundaries[s + 1]).

    A pure function of its arguments, like `batch_indices`: position p of the endless stream lies in
    round p // R (R = sum(quotas)), whose seeded order says which source serves p and how many draws
    that source had before it; draw n of source s is its example permutation(seed, s, n // N_s)[n % N_s],
    so each source is walked epoch by epoch, without replacement, at its own pace.
    """
    per_round, quota = sum(quotas), np.asarray(quotas, dtype=np.int64)
    positions = step * global_batch_size + np.arange(global_batch_size, dtype=np.int64)
    sources, draws = np.empty_like(positions), np.empty_like(positions)
    for r in np.unique(positions // per_round).tolist():
        sel = positions // per_round == r
        order, occurrence = _round_order(seed, r, quotas)
        slots = positions[sel] % per_round
        sources[sel] = order[slots]
        draws[sel] = r * quota[order[slots]] + occurrence[slots]
    out = np.empty_like(positions)
    for source in np.unique(sources).tolist():
        size = int(boundaries[source + 1] - boundaries[source])
        sel = sources == source
        out[sel] = boundaries[source] + _stream_positions(seed, draws[sel], size, stream=1 + source)
    return out


def micro_batch(indices: np.ndarray, rank: int, world_size: int, micro_index: int,
                micro_batch_size: int) -> np.ndarray:
    """This rank's slice of a global batch for micro-step `micro_index` (rank-major within a micro-step)."""
    start = (micro_index * world_size + rank) * micro_batch_size
    if start + micro_batch_size > len(indices):
        raise ValueError(f"micro-batch {micro_index} of rank {rank} lies outside a global batch of {len(indices)}")
    return indices[start:start + micro_batch_size]


# ---------------------------------------------------------------- dataset


class TokenDataset:
    """Rows of tokens (flat array + row offsets), optionally a target mask and position ids."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray, mask: np.ndarray | None,
                 positions: np.ndarray | None, row_targets: np.ndarray, pad_id: int) -> None:
        self.ids, self.offsets, self.mask, self.positions = ids, offsets, mask, positions
        self.row_targets, self.pad_id = row_targets, pad_id
        self.mix: tuple[tuple[int, ...], np.ndarray] | None = None
        """A mixture's (quotas per round, source boundaries): set by `build_datasets` for `data.mix`."""
        lengths = np.diff(offsets)
        self.block = int(lengths[0]) if len(lengths) and mask is None and positions is None \
            and (lengths == lengths[0]).all() else 0
        """Row length when every row is a full block (fast path: one reshape, no padding)."""

    @classmethod
    def load(cls, entry: Path, split: str, pad_id: int) -> TokenDataset:
        """Memory-map a split of a cache entry."""
        def get(name: str) -> np.ndarray | None:
            path = entry / f"{split}_{name}.npy"
            return np.load(path, mmap_mode="r") if path.exists() else None

        return cls(get("ids"), np.load(entry / f"{split}_offsets.npy"), get("mask"), get("positions"),
                   np.load(entry / f"{split}_row_targets.npy"), pad_id)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def step_indices(self, seed: int, step: int, global_batch_size: int) -> np.ndarray:
        """The rows of the global batch at optimizer step `step`: the trainer's one question to its data."""
        if self.mix is not None:
            return mix_indices(seed, step, global_batch_size, *self.mix)
        return batch_indices(seed, step, global_batch_size, len(self))

    def position(self, step: int, global_batch_size: int) -> dict[str, Any]:
        """Where the data stands before step `step`, for a checkpoint: nothing, the sampler is stateless."""
        return {}

    def restore(self, position: dict[str, Any]) -> None:
        """Continue from a checkpoint's `position`: nothing to do for a stateless sampler."""

    def num_targets(self, indices: np.ndarray) -> int:
        """Label tokens that count after the model's shift: sum of (labels[:, 1:] != -100)."""
        return int(self.row_targets[np.asarray(indices)].sum())

    def get_batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """input_ids and labels (B, L) int64, aligned (the loss shifts); position_ids for packed SFT rows. Never an
        attention_mask: the padding is on the right, after every real token, and its targets are -100, so a mask would
        change no loss but cost SDPA its flash path (docs/explanation/gpu-path.md, "Attention and the mask")."""
        import torch

        indices = np.asarray(indices, dtype=np.int64)
        if self.block:
            rows = self.ids.reshape(-1, self.block)[indices].astype(np.int64)
            return {"input_ids": torch.from_numpy(rows), "labels": torch.from_numpy(rows.copy())}
        starts, ends = self.offsets[indices], self.offsets[indices + 1]
        width = int((ends - starts).max())
        input_ids = np.full((len(indices), width), self.pad_id, dtype=np.int64)
        labels = np.full((len(indices), width), IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros((len(indices), width), dtype=np.int64) if self.positions is not None else None
        for row, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
            input_ids[row, : b - a] = self.ids[a:b]
            target = self.mask[a:b].astype(bool) if self.mask is not None else slice(None)
            labels[row, : b - a][target] = input_ids[row, : b - a][target]
            if positions is not None:
                positions[row, : b - a] = self.positions[a:b]
                positions[row, b - a:] = np.arange(width - (b - a))  # padding: a segment of its own
        batch = {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)}
        if positions is not None:
            batch["position_ids"] = torch.from_numpy(positions)
        return batch


# ---------------------------------------------------------------- cutting examples


def _truncate(ids: list[np.ndarray], masks: list[np.ndarray] | None, max_length: int,
              stats: dict[str, int]) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Cut each example to `max_length`, then drop those left without a target token."""
    over = [len(x) - max_length for x in ids if len(x) > max_length]
    stats["truncated_examples"], stats["truncated_tokens"] = len(over), int(sum(over))
    ids = [x[:max_length] for x in ids]
    masks = [m[:max_length] for m in masks] if masks is not None else None
    keep = [i for i, x in enumerate(ids) if (masks[i][1:].any() if masks is not None else len(x) >= 2)]
    stats["dropped_examples"] = len(ids) - len(keep)
    stats["dropped_tokens"] = sum(len(x) for x in ids) - sum(len(ids[i]) for i in keep)  # what truncation left them
    return [ids[i] for i in keep], [masks[i] for i in keep] if masks is not None else None


def _row_targets(offsets: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Per row, the label tokens left after the shift (the row's first token is never a target)."""
    if mask is None:
        return (np.diff(offsets) - 1).astype(np.int64)
    return (np.add.reduceat(mask.astype(np.int64), offsets[:-1]) - mask[offsets[:-1]]).astype(np.int64)


def _cut_blocks(ids: list[np.ndarray], max_length: int, keep_tail: bool,
                stats: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """Documents joined (each already ends in eos) and cut into full blocks: (flat ids, row offsets)."""
    flat = np.concatenate(ids) if ids else np.empty(0, np.int64)
    full = len(flat) // max_length * max_length
    cuts = list(range(0, full + 1, max_length))
    if keep_tail and len(flat) - full >= 2:  # eval keeps its last partial block: every held-out token is scored
        cuts.append(len(flat))
    else:
        stats["dropped_tokens"], flat = len(flat) - full, flat[:full]
    return flat, np.asarray(cuts, dtype=np.int64)


def _pack_rows(lengths: np.ndarray, max_length: int) -> np.ndarray:
    """Row offsets of whole examples packed greedily, in order, into rows of at most `max_length`."""
    ends = np.cumsum(lengths)
    row_starts, used = [0], 0
    for i, n in enumerate(lengths.tolist()):
        if used + n > max_length:
            row_starts.append(int(ends[i] - n))
            used = 0
        used += n
    return np.asarray([*row_starts, int(ends[-1])], dtype=np.int64)


SPLIT_STATS = ("records", "truncated_examples", "truncated_tokens", "dropped_examples", "dropped_tokens", "examples",
               "tokens", "target_tokens")
"""The counts `cut_examples` gives of a split, which a cache entry's meta.json keeps (data_<split>_<count>)."""


def cut_examples(mode: str, ids: list[np.ndarray], masks: list[np.ndarray] | None, max_length: int,
                 keep_tail: bool) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Arrays of one split (ids, offsets, mask?, positions?, row_targets) and its counts."""
    stats = {**dict.fromkeys(SPLIT_STATS, 0), "records": len(ids)}
    arrays: dict[str, np.ndarray] = {}
    if mode == "lm_packed":
        flat, offsets = _cut_blocks(ids, max_length, keep_tail, stats)
    else:
        ids, masks = _truncate(ids, masks, max_length, stats)
        lengths = np.array([len(x) for x in ids], dtype=np.int64)
        flat = np.concatenate(ids) if ids else np.empty(0, np.int64)
        if mode == "sft_packed" and ids:
            offsets = _pack_rows(lengths, max_length)
            arrays["positions"] = np.concatenate([np.arange(n) for n in lengths]).astype(np.uint16)
        else:
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        if masks is not None:
            arrays["mask"] = np.concatenate(masks).astype(np.uint8) if masks else np.empty(0, np.uint8)
    arrays["ids"], arrays["offsets"] = flat, offsets
    arrays["row_targets"] = _row_targets(offsets, arrays.get("mask"))
    stats.update(examples=len(offsets) - 1, tokens=int(offsets[-1]), target_tokens=int(arrays["row_targets"].sum()))
    return arrays, stats


def check_packing_supported(cfg: DictConfig) -> None:
    """SFT packing is only right if attention stops at example boundaries: refuse where it may not."""
    if cfg.model.trust_remote_code:
        raise UserError("data.packing=true for SFT records relies on transformers' packed-sequence attention "
                        "(position_ids restarting per example); remote model code may ignore it and let examples "
                        "attend to each other. Set data.packing=false")
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        raise UserError("data.packing=true for SFT records needs transformers >= 4.53 (packed-sequence masks); "
                        "upgrade transformers or set data.packing=false") from None


# ---------------------------------------------------------------- build


def _settings(cfg: DictConfig) -> dict[str, Any]:
    d = cfg.data
    return {"format": FORMAT_VERSION, "name": d.name, "max_length": int(d.max_length), "packing": bool(d.packing)}


def pad_id_of(tok: Any) -> int:
    """The id that pads rows: the tokenizer's pad token, else its eos (labels mask padding out anyway)."""
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)


MODES = ("lm_packed", "sft_packed", "padded")


def example_mode(cfg: DictConfig, sft: bool) -> str:
    """How records become rows: `lm_packed`, `sft_packed` (where `check_packing_supported` allows it) or `padded`
    (the module docstring's pages)."""
    mode = ("sft_packed" if sft else "lm_packed") if cfg.data.packing else "padded"
    if mode == "sft_packed":
        check_packing_supported(cfg)
    return mode


def encode_records(mode: str, recs: list[Record], tok: Any) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Token ids per record, and a target mask per record for SFT records (None: every token a target)."""
    from llmexp.data.encode import encode_lm, encode_sft

    if mode == "lm_packed" or (mode == "padded" and all("text" in r for r in recs)):
        return encode_lm([r["text"] for r in recs], tok), None
    return encode_sft(recs, tok)


def _encode_cut(mode: str, recs: list[Record], tok: Any, cfg: DictConfig, split: str,
                source: str) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """One split of one source as token arrays; `source` names it in the error when nothing is usable."""
    ids, masks = encode_records(mode, recs, tok)
    arrays, stats = cut_examples(mode, ids, masks, int(cfg.data.max_length), keep_tail=split == "eval")
    if stats["examples"] == 0 and mode == "lm_packed":  # all of it shorter than one block: a longer one cannot help
        raise UserError(f"{source} has no usable records: its {stats['records']} record(s) hold "
                        f"{stats['dropped_tokens']} token(s), fewer than one block of data.max_length="
                        f"{cfg.data.max_length}. Lower data.max_length or add data")
    if stats["examples"] == 0:
        why, fix = (f"left without a target token after truncation to data.max_length={cfg.data.max_length}",
                    "Add data or raise data.max_length") if stats["truncated_examples"] else \
            ("too short to train on (a text needs 2 tokens, a completion 1; empty ones have none)", "Add data")
        raise UserError(f"{source} has no usable records: {stats['records']} record(s), {stats['dropped_examples']} "
                        f"{why}, {stats['tokens']} token(s) in all. {fix}")
    return arrays, stats


def concat_columns(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Several sources' arrays as one split: rows follow each other, offsets shifted."""
    if len(parts) == 1:
        return parts[0]
    shifts = np.cumsum([0] + [int(p["offsets"][-1]) for p in parts[:-1]])
    out = {"offsets": np.concatenate([parts[0]["offsets"][:1]] + [p["offsets"][1:] + shift
                                                                 for p, shift in zip(parts, shifts, strict=True)])}
    for name in parts[0].keys() - {"offsets"}:
        out[name] = np.concatenate([p[name] for p in parts])
    return out


def _source_name(cfg: DictConfig, split: str, index: int) -> str:
    d = cfg.data
    if d.mix and split == "eval":  # every source's held-out records, interleaved
        return "the eval split of data.mix (all sources' held-out records)"
    if d.mix:
        return f"data.mix[{index}] ({d.mix[index].path}), {split} split,"
    if d.get(f"{split}_file"):
        return f"data.{split}_file={d[f'{split}_file']}"
    return f"the {split} split of data={d.name}"


OWN_EVAL = {"json": "eval_file", "text": "eval_file", "hf": "eval_split"}
"""The `data` key that gives a corpus an eval set of its own (stdlib holds out files); unset, a corpus holds out
data.eval_fraction of its training records."""


def _empty_split_error(cfg: DictConfig, split: str, index: int) -> UserError:
    """The error for a split with no records: its fix depends on whether it is held out of the training records."""
    name = f"mix[{index}].eval_split" if cfg.data.mix else OWN_EVAL.get(cfg.data.name)
    key, own = (f"data.{name}", OmegaConf.select(cfg.data, name)) if name else (None, None)
    if split == "train":
        fix = "add records to it" if own else "add data or lower data.eval_fraction"
        return UserError(f"{_source_name(cfg, 'train', index)} is empty; {fix}")
    if own and not cfg.data.mix:
        return UserError(f"{key}={own} is empty; add records to it")
    key = "data.mix[i].eval_split" if cfg.data.mix else key  # (every source's held-out records are empty)
    fix = f"set {key} or raise data.eval_fraction" if key else "raise data.eval_fraction"
    return UserError(f"data={cfg.data.name}: the eval split is empty; {fix}")


def build_datasets(cfg: DictConfig, tokenizer: Any) -> tuple[TokenDataset, TokenDataset, dict[str, Any]]:
    """The train and eval datasets and their stats (for summary.json), from the cache when possible."""
    from llmexp.data.tokenizer import tokenizer_fingerprint

    start = time.perf_counter()
    corpora = load_corpora(cfg.data)
    sources = [c.fingerprint for c in corpora]
    key = hash_obj({**_settings(cfg), "corpus": sources if cfg.data.mix else sources[0],  # (a mix keeps its sources)
                    "tokenizer": tokenizer_fingerprint(tokenizer)})
    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.int32

    def build(tmp: Path) -> dict[str, Any]:
        loaded = [c.load() for c in corpora]
        for i, (train_recs, _) in enumerate(loaded):
            if not train_recs:
                raise _empty_split_error(cfg, "train", i)
        # records taken in turn from each source: a mixture's eval slice (`train.eval_batches`) covers every source
        eval_recs = [r for turn in itertools.zip_longest(*(held for _, held in loaded)) for r in turn if r is not None]
        if not eval_recs:
            raise _empty_split_error(cfg, "eval", 0)
        sft = cfg.data.name == "stdlib_sft" or any("text" not in r for recs, held in loaded for r in recs + held)
        mode = example_mode(cfg, sft)
        train_parts = [_encode_cut(mode, recs, tokenizer, cfg, "train", _source_name(cfg, "train", i))
                       for i, (recs, _) in enumerate(loaded)]
        eval_part = _encode_cut(mode, eval_recs, tokenizer, cfg, "eval", _source_name(cfg, "eval", 0))
        stats: dict[str, Any] = {"mode": mode}
        for split, parts in (("train", train_parts), ("eval", [eval_part])):
            arrays = concat_columns([p[0] for p in parts])
            arrays["ids"] = arrays["ids"].astype(dtype)
            for name, array in arrays.items():
                save_array(tmp, f"{split}_{name}", array)
            stats.update({f"{split}_{k}": sum(p[1][k] for p in parts) for k in parts[0][1]})
        if cfg.data.mix:  # where each source's examples start and end: the mixture sampler's
            examples = [p[1]["examples"] for p in train_parts]
            save_array(tmp, "train_sources", np.cumsum([0, *examples]).astype(np.int64))
            stats["train_source_examples"] = examples
        return {"key": key, "settings": _settings(cfg), "stats": stats}

    def load(entry: Path, meta: dict[str, Any]) -> tuple[TokenDataset, TokenDataset, Any, dict[str, Any]]:
        # the build's stats are read here, where an entry whose meta.json lacks them is a miss (`cached`)
        built = meta["stats"]
        if not isinstance(built, dict) or "mode" not in built or built["mode"] not in MODES:
            raise ValueError(f"its meta.json's stats.mode is not one of {', '.join(MODES)}")
        if lacking := [f"{split}_{k}" for split in ("train", "eval") for k in SPLIT_STATS
                       if not isinstance(built.get(f"{split}_{k}"), int)]:  # (the header would show "?" tokens)
            raise ValueError(f"its meta.json's stats lack the counts {', '.join(lacking[:3])}")
        train, held = (TokenDataset.load(entry, split, pad_id_of(tokenizer)) for split in ("train", "eval"))
        return train, held, np.load(entry / "train_sources.npy") if cfg.data.mix else None, built

    (train, held, sources, built), _, hit = cached(Path(str(cfg.data.cache_dir)), "tokens", key, build, load)
    if built["mode"] == "sft_packed":
        check_packing_supported(cfg)
    stats: dict[str, Any] = {}
    if cfg.data.mix:
        quotas = tuple(mix_quotas([float(s.weight) for s in cfg.data.mix]))
        train.mix = (quotas, sources)
        stats["data_mix_shares"] = [q / sum(quotas) for q in quotas]
    stats.update({f"data_{k}": v for k, v in built.items()})
    stats.update(data_cache_hit=hit, data_cache_key=key, data_prep_s=round(time.perf_counter() - start, 3))
    return train, held, stats
