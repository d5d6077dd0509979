"""The scorers: the log-likelihood of each choice of a multiple-choice item, and greedy generation.

Multiple choice follows lm-evaluation-harness (`lm_eval.api.model.TemplateLM.loglikelihood` and `_encode_pair`,
`lm_eval.api.task.ConfigurableTask.process_results`), so the numbers are those the harness and OLMo report; how a
choice is encoded and scored, and how tests/test_evals.py checks it against the harness itself: docs/how-to/evals.md
("The scorer is the harness's"). `acc_norm` is the highest score per character of the choice.

Ranks share the items (item i goes to rank i % world); each returns sums the caller adds up over the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from llmexp.evals.items import ChoiceItem, GenerateItem
from llmexp.model.loss import IGNORE_INDEX
from llmexp.model.rng import eval_mode


@dataclass(frozen=True)
class Shard:
    """This process's part of a task: items i with i % world == rank."""

    rank: int = 0
    world: int = 1
    lockstep: bool = False
    """Every forward is collective (FSDP): every rank must run as many, so a rank short of work repeats one."""

    def mine(self, n: int) -> range:
        return range(self.rank, n, self.world)


@dataclass(frozen=True)
class Request:
    """One (context, continuation) pair to score, as token ids."""

    item: int
    choice: int
    context: tuple[int, ...]
    continuation: tuple[int, ...]


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's `_encode_pair` (causal models): trailing whitespace of the context goes to the
    continuation; the continuation's tokens are those of the whole text after the context's own. An empty
    context is conditioned on the eos token (the harness's `prefix_token_id` for such tokenizers)."""
    if not context:
        cont = tokenizer.encode(continuation, add_special_tokens=False)
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        return ([prefix], cont) if prefix != cont[0] else (cont[:1], cont[1:])
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return ctx, whole[len(ctx):]


def choice_requests(tokenizer: Any, items: Sequence[ChoiceItem], indices: Sequence[int],
                    delimiter: str) -> list[Request]:
    """Every choice of the items at `indices` as a request."""
    encoded = [(i, j, encode_pair(tokenizer, items[i].context, delimiter + choice))
               for i in indices for j, choice in enumerate(items[i].choices)]
    return [Request(i, j, tuple(ctx), tuple(cont)) for i, j, (ctx, cont) in encoded]


def _batch(requests: Sequence[Request], max_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, their attention mask, and labels on the continuation tokens only. A sequence
    longer than `max_length` keeps its last `max_length` tokens (the context is cut from the left)."""
    seqs = [torch.tensor((r.context + r.continuation)[-max_length:], dtype=torch.long) for r in requests]
    ids = pad_sequence(seqs, batch_first=True, padding_value=pad_id)
    mask = pad_sequence([torch.ones_like(seq) for seq in seqs], batch_first=True)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for row, (seq, req) in enumerate(zip(seqs, requests, strict=True)):
        n, k = len(seq), min(len(req.continuation), len(seq) - 1)
        labels[row, n - k:n] = seq[n - k:]
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@torch.no_grad()
def loglikelihoods(model: torch.nn.Module, requests: Sequence[Request], *, batch_size: int, max_length: int,
                   pad_id: int, device: torch.device, autocast: Callable[[], AbstractContextManager[Any]],
                   rounds: int | None = None) -> list[float]:
    """The log-likelihood of each request's continuation given its context, in the order given.

    `model` is the run's model (its forward returns loss sums: `llmexp.model.loss.CausalLMLoss`). Longest
    first, as the harness batches. `rounds`: run at least this many forwards (lockstep ranks repeat a batch
    whose result they drop)."""
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].context + requests[i].continuation))
    out = [math.nan] * len(requests)
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    with eval_mode(model):
        for b in range(max(len(batches), rounds or 0)):
            chunk = batches[b] if b < len(batches) else (batches[0] if batches else None)
            # (lockstep with no work at all: a one-token forward keeps the collectives matched)
            todo = [requests[i] for i in chunk] if chunk is not None else [Request(0, 0, (pad_id,), (pad_id,))]
            batch = _batch(todo, max_length, pad_id)
            with autocast():
                sums = model(**{k: v.to(device) for k, v in batch.items()}, per_row=True).float().cpu()
            if b < len(batches):
                for row, i in enumerate(chunk):
                    out[i] = -float(sums[row])
    return out


def choice_rounds(items: Sequence[ChoiceItem], shard: Shard, batch_size: int) -> int:
    """The most forwards any rank runs for these items: the lockstep count."""
    per_rank = [sum(len(items[i].choices) for i in range(r, len(items), shard.world)) for r in range(shard.world)]
    return max(-(-n // batch_size) for n in per_rank)


def choice_tally(items: Sequence[ChoiceItem], requests: Sequence[Request], scores: Sequence[float]) -> list[float]:
    """[right by acc, right by acc_norm, items] over the items these requests cover (argmax ties: the first)."""
    by_item: dict[int, list[float]] = {}
    for req, score in zip(requests, scores, strict=True):
        by_item.setdefault(req.item, [math.nan] * len(items[req.item].choices))[req.choice] = score
    right = right_norm = 0.0
    for i, lls in by_item.items():
        norm = [ll / len(c) for ll, c in zip(lls, items[i].choices, strict=True)]
        right += float(max(range(len(lls)), key=lambda j: (lls[j], -j)) == items[i].answer)
        right_norm += float(max(range(len(norm)), key=lambda j: (norm[j], -j)) == items[i].answer)
    return [right, right_norm, float(len(by_item))]


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """The completion up to the first stop string."""
    return text[:min((i for s in stop if s and (i := text.find(s)) >= 0), default=len(text))]


def prompt_budget(max_length: int, max_new_tokens: int) -> int:
    """The tokens a prompt keeps (its last ones) so that it and its continuation fit `max_length`."""
    return max(1, max_length - max_new_tokens)


@torch.no_grad()
def greedy_completions(lm: Any, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int, stop: Sequence[str],
                       batch_size: int, max_length: int, device: torch.device,
                       autocast: Callable[[], AbstractContextManager[Any]]) -> list[str]:
    """Greedy continuations of the prompts (left-padded batches through `generate`), cut at the stop strings.
    A prompt keeps its last `max_length - max_new_tokens` tokens."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    keep = prompt_budget(max_length, max_new_tokens)
    out: list[str] = []
    with eval_mode(lm):
        for s in range(0, len(prompts), batch_size):
            encoded = [tokenizer.encode(p)[-keep:] or [pad] for p in prompts[s:s + batch_size]]
            width = max(len(e) for e in encoded)
            ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=device)
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
            with autocast():
                gen = lm.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                  temperature=None, top_p=None, top_k=None, pad_token_id=pad)
            out += [cut_at_stop(tokenizer.decode(row[width:], skip_special_tokens=True), stop) for row in gen]
    return out


def generate_tally(items: Sequence[GenerateItem], indices: Sequence[int],
                   completions: Sequence[str]) -> list[float]:
    """[exact matches, targets contained, items]: whitespace at either end of a completion or target does not count."""
    em = contains = 0.0
    for i, completion in zip(indices, completions, strict=True):
        want = items[i].target.strip()
        em, contains = em + float(completion.strip() == want), contains + float(want in completion)
    return [em, contains, float(len(indices))]
