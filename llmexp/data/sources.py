"""The corpus a `data` config node names: the standard library, JSON/text files, or a `datasets` dataset."""

from __future__ import annotations

from typing import Any

from llmexp.data.corpora import Corpus, stdlib_corpus, user_corpus
from llmexp.data.hub import hf_corpus
from llmexp.errors import UserError


def load_corpus(d: Any) -> Corpus:
    """The corpus `data.name` names (`d` is the `data` config node)."""
    if d.name in ("stdlib", "stdlib_sft"):
        return stdlib_corpus(d)
    if d.name in ("json", "text"):
        return user_corpus(d)
    if d.name == "hf":
        return hf_corpus(d)
    raise UserError(f"data.name={d.name!r} is not one of stdlib, stdlib_sft, json, text, hf")
