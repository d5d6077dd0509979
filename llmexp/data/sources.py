"""The corpus a `data` config node names: the standard library, JSON/text files, a `datasets`
dataset, or (`data.mix`) several `datasets` datasets, one corpus each."""

from __future__ import annotations

import itertools
from typing import Any

from omegaconf import DictConfig, OmegaConf

from llmexp.data.corpora import Corpus, Record, stdlib_corpus, user_corpus
from llmexp.data.hub import SOURCE_KEY, hf_corpus
from llmexp.errors import UserError

CORPORA = {"stdlib": stdlib_corpus, "stdlib_sft": stdlib_corpus, "json": user_corpus, "text": user_corpus,
           "hf": hf_corpus}


def load_corpora(d: Any) -> list[Corpus]:
    """One corpus per source: each `data.mix` entry, or the one corpus `data.name` names."""
    if d.name == "hf" and d.mix:
        return [hf_corpus(mix_source(d, i)) for i in range(len(d.mix))]
    if d.name not in CORPORA:
        raise UserError(f"data.name={d.name!r} is not one of {', '.join(CORPORA)}")
    return [CORPORA[d.name](d)]


def load_corpus(d: Any) -> Corpus:
    """All of the data as one corpus (what a tokenizer is trained on): a mixture's sources joined."""
    corpora = load_corpora(d)
    return corpora[0] if len(corpora) == 1 else _joined(corpora)


def mix_source(d: Any, index: int) -> DictConfig:
    """`data.mix[index]` as a `data=hf` node: the entry's own fields over the mixture's shared ones."""
    shared = {"eval_fraction": d.eval_fraction, "max_examples": d.max_examples, SOURCE_KEY: f"data.mix[{index}]"}
    return OmegaConf.create({**shared, **OmegaConf.to_container(d.mix[index])})


def _joined(corpora: list[Corpus]) -> Corpus:
    def load() -> tuple[list[Record], list[Record]]:
        parts = [c.load() for c in corpora]
        return [r for train, _ in parts for r in train], [r for _, held in parts for r in held]

    return Corpus("mix", {"mix": [c.fingerprint for c in corpora]}, {"mix": [c.bpe_fingerprint for c in corpora]},
                  load, lambda: itertools.chain.from_iterable(c.bpe_texts() for c in corpora))
