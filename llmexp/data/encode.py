"""Records to token ids, with a per-token target mask for SFT records.

A record is rendered to one string plus the character spans that carry the loss; the string is
tokenised once (so prompt and completion tokenise jointly, exactly as at inference) and a token
is a target when its first character lies inside a span. A token that straddles the prompt/
completion boundary counts with the prompt.

Each record shape and which of its tokens are targets: docs/how-to/data.md ("Records, length and packing"); with a
chat template, an assistant turn's targets are the turn as the template renders it, end-of-turn tokens included.

Tokenisation runs in the `tokenizers` Rust thread pool (all cores); rendering is plain Python.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from llmexp.data.corpora import PLAIN_ROLE_HEADERS, Record
from llmexp.errors import UserError, first_line

Spans = list[tuple[int, int]]


def _chat_spans(messages: list[dict[str, str]], tok: Any) -> tuple[str, Spans]:
    """Render with the tokenizer's chat template; each assistant turn's span is the difference
    between the conversation up to it and the same prefix with the generation prompt."""
    full = tok.apply_chat_template(messages, tokenize=False)
    spans: Spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise UserError("the tokenizer's chat template renders a conversation differently from its prefixes, "
                            "so assistant turns cannot be located; use prompt/completion records, or set "
                            "data.tokenizer to a tokenizer whose template is prefix-stable")
        spans.append((len(before), len(upto)))
    return full, spans


def _plain_spans(messages: list[dict[str, str]], eos: str) -> tuple[str, Spans]:
    text, spans = "", []
    for msg in messages:
        header, end = PLAIN_ROLE_HEADERS[msg["role"]], eos if msg["role"] == "assistant" else ""
        if msg["role"] == "assistant":
            start = len(text) + len(header)
            spans.append((start, start + len(msg["content"]) + len(end)))
        text += f"{header}{msg['content']}{end}\n\n"
    return text, spans


def render(i: int, rec: Record, tok: Any) -> tuple[str, Spans, bool]:
    """(text, target character spans, add the tokenizer's own special tokens?) of record `i`; a chat template's own
    refusal (Gemma's and Mistral's raise on a system turn) or syntax error is the user's mistake it is."""
    eos = tok.eos_token
    if "text" in rec:
        text = rec["text"] + eos
        return text, [(0, len(text))], True
    if "prompt" in rec:
        text = rec["prompt"] + rec["completion"] + eos
        return text, [(len(rec["prompt"]), len(text))], True
    if not getattr(tok, "chat_template", None):
        return (*_plain_spans(rec["messages"], eos), True)
    from jinja2 import TemplateError

    try:
        return (*_chat_spans(rec["messages"], tok), False)  # templates write their own bos
    except TemplateError as err:
        raise UserError(f"record {i}: the tokenizer's chat template fails on it ({type(err).__name__}: "
                        f"{first_line(err)}); change the conversation (a role the template refuses?), or set "
                        "data.tokenizer to a tokenizer whose template takes it") from None


def encode_lm(texts: list[str], tok: Any) -> list[np.ndarray]:
    """Pretraining documents: ids of each text followed by eos (every token a target)."""
    eos = np.array([tok.eos_token_id], dtype=np.int64)
    encodings = tok.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=True)
    return [np.concatenate([np.asarray(e.ids, dtype=np.int64), eos]) for e in encodings]


def encode_sft(records: list[Record], tok: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """SFT examples: ids and a boolean target mask per record. The first token is never a target
    (nothing precedes it), which also keeps packed examples from predicting across boundaries."""
    rendered = [render(i, r, tok) for i, r in enumerate(records)]
    ids: list[np.ndarray] = [np.empty(0, np.int64)] * len(records)
    masks: list[np.ndarray] = [np.empty(0, bool)] * len(records)
    for special in (True, False):
        which = [i for i, r in enumerate(rendered) if r[2] is special]
        if not which:
            continue
        encodings = tok.backend_tokenizer.encode_batch([rendered[i][0] for i in which], add_special_tokens=special)
        for i, enc in zip(which, encodings, strict=True):
            starts = np.fromiter((o[0] for o in enc.offsets), dtype=np.int64, count=len(enc.offsets))
            mask = np.zeros(len(starts), dtype=bool)
            for a, b in rendered[i][1]:
                mask |= (starts >= a) & (starts < b)
            mask[:1] = False
            ids[i], masks[i] = np.asarray(enc.ids, dtype=np.int64), mask
    return ids, masks
