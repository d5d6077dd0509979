"""Downstream tasks at every eval (`eval` config group): `build_suite` once, after the data; `run_tasks` at every
eval. The scorers are `llmexp.evals`'; this module only splits the work between ranks and adds it up (item i on
rank i % world; the harness on rank 0 alone): docs/how-to/evals.md, "Several processes".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from llmexp.config.schema import PerplexitySetConfig
from llmexp.data.datasets import TokenDataset, build_datasets, pad_id_of
from llmexp.data.sources import load_corpora
from llmexp.errors import UserError
from llmexp.evals import harness, score
from llmexp.evals.demo import demo_items
from llmexp.evals.items import ChoiceItem, GenerateItem, TaskFiles
from llmexp.monitor.logger import safe_exp
from llmexp.rundir.task_metrics import TASK_EVENT
from llmexp.train.state import Run


@dataclass
class TaskSuite:
    """Everything the evals score besides the held-out loss, built once per run."""

    choice: dict[str, tuple[list[ChoiceItem], str]] = field(default_factory=dict)
    """name -> (items, delimiter); the demo task is one of them."""
    generate: dict[str, tuple[list[GenerateItem], DictConfig]] = field(default_factory=dict)
    perplexity: dict[str, TokenDataset] = field(default_factory=dict)
    harness: Any = None
    """lm-evaluation-harness's task index, when `eval.lm_eval.tasks` names any (rank 0 only)."""


def perplexity_cfg(cfg: DictConfig, entry: DictConfig) -> DictConfig:
    """The run's config with `data` replaced by an extra held-out set's: the entry's fields over the run's data
    (fields left at their defaults keep the run's), one source, no streaming."""
    defaults = OmegaConf.to_container(OmegaConf.structured(PerplexitySetConfig))
    fields = {k: v for k, v in OmegaConf.to_container(entry, resolve=True).items()  # type: ignore[union-attr]
              if v != defaults[k]}  # type: ignore[index]
    data = {**OmegaConf.to_container(cfg.data, resolve=True), "mix": [], "streaming": False, **fields}  # type: ignore[dict-item]
    if data["name"] in ("json", "text") and not fields.get("train_file") and fields.get("eval_file"):
        data["train_file"] = fields["eval_file"]  # only its eval split is read; the builder wants a train side
    if data["name"] != cfg.data.name and "path" not in fields:
        data["path"] = None
    plain = {key: OmegaConf.to_container(cfg[key], resolve=True) if OmegaConf.is_config(cfg[key]) else cfg[key]
             for key in cfg if key not in ("hydra", "data")}  # (in-process tests compose a hydra node too)
    return OmegaConf.create({**plain, "data": data})


def build_suite(cfg: DictConfig, tokenizer: Any, files: TaskFiles, is_main: bool) -> TaskSuite | None:
    """The demo items (from the held-out records of the run's data), the extra held-out sets (through the token
    cache, as the run's own), and the harness's index; None when the `eval` group names no task."""
    ev = cfg.eval
    suite = TaskSuite(choice={n: (items, ev.multiple_choice[n].delimiter) for n, items in files.choice.items()},
                      generate={n: (items, ev.generate[n]) for n, items in files.generate.items()})
    if ev.demo_items > 0:
        suite.choice["demo"] = (_demo_items(cfg), "")
    for name, entry in ev.perplexity.items():
        suite.perplexity[str(name)] = build_datasets(perplexity_cfg(cfg, entry), tokenizer)[1]
    if ev.lm_eval.tasks and is_main:
        lm = ev.lm_eval
        suite.harness = harness.task_manager(lm.include_path, lm.include_defaults)
        harness.check_tasks(suite.harness, list(lm.tasks), lm.include_path, lm.include_defaults)
        harness.check_task_data(suite.harness, list(lm.tasks))
    named = suite.choice or suite.generate or suite.perplexity or suite.harness is not None
    return suite if named else None  # (a harness-only suite is rank 0's: the others wait at the next collective)


def _demo_items(cfg: DictConfig) -> list[ChoiceItem]:
    held = [r for corpus in load_corpora(cfg.data) for r in corpus.load()[1]]
    items = demo_items(held, int(cfg.eval.demo_items), seed=0)
    if not items:
        raise UserError(f"eval.demo_items={cfg.eval.demo_items}: the held-out part of data={cfg.data.name} has no "
                        "lines to build the demo task from; use another eval option, or eval.demo_items=0")
    return items


def run_tasks(suite: TaskSuite, run: Run, step: int, loss_of: Callable[[TokenDataset], float]) -> list[dict[str, Any]]:
    """Every task of `suite` at this eval, logged as one `eval_task` record each; returns the records (every
    rank). `loss_of` is the loop's own held-out loss, which scores the extra held-out sets."""
    records = []
    for name, ds in suite.perplexity.items():
        start = time.perf_counter()
        loss = loss_of(ds)
        records.append(_record(step, name, "perplexity", {"loss": loss, "ppl": safe_exp(loss)},
                               scored_examples(run, len(ds)), start))
    records += [_choice_task(run, step, name, items, delimiter) for name, (items, delimiter) in suite.choice.items()]
    records += [_generate_task(run, step, name, items, task) for name, (items, task) in suite.generate.items()]
    if suite.harness is not None:
        records += _harness_tasks(run, suite.harness, step)
    for record in records:
        run.log.log(record)
    return records


def scored_examples(run: Run, num_examples: int) -> int:
    """How many of a held-out set's examples an eval scores: `train.eval_batches` global batches (0: all)."""
    plan, batches = run.desc.plan, run.cfg.train.eval_batches
    return min(num_examples, batches * plan.micro * plan.world) if batches > 0 else num_examples


def _record(step: int, name: str, kind: str, metrics: dict[str, float], n: int, start: float,
            **extra: Any) -> dict[str, Any]:
    return {"event": TASK_EVENT, "step": step, "task": name, "kind": kind, "metrics": metrics, "items": n,
            "seconds": round(time.perf_counter() - start, 3), **extra}


def _shard(run: Run) -> score.Shard:
    """This rank's share. With several ranks every rank runs as many forwards: FSDP and ZeRO-3 gather weights in
    each one, and DDP may broadcast buffers in each one; a rank short of items repeats a batch."""
    world = run.desc.plan.world
    return score.Shard(run.rt.rank, world, world > 1)


def _shares(run: Run, names: tuple[str, str], tally: list[float]) -> tuple[dict[str, float], int]:
    *counts, n = run.rt.reduce_sum(torch.tensor(tally, device=run.rt.device, dtype=torch.float64)).tolist()
    return {name: count / max(n, 1.0) for name, count in zip(names, counts, strict=True)}, int(n)


def _choice_task(run: Run, step: int, name: str, items: list[ChoiceItem], delimiter: str) -> dict[str, Any]:
    start, rt, shard, bs = time.perf_counter(), run.rt, _shard(run), int(run.cfg.eval.batch_size)
    requests = score.choice_requests(run.tokenizer, items, shard.mine(len(items)), delimiter)
    lls = score.loglikelihoods(run.model, requests, batch_size=bs, max_length=int(run.cfg.data.max_length),
                               pad_id=pad_id_of(run.tokenizer), device=rt.device, autocast=rt.compute,
                               rounds=score.choice_rounds(items, shard, bs) if shard.lockstep else None)
    metrics, n = _shares(run, ("acc", "acc_norm"), score.choice_tally(items, requests, lls))
    return _record(step, name, "multiple_choice", metrics, n, start)


def _generate_task(run: Run, step: int, name: str, items: list[GenerateItem], task: DictConfig) -> dict[str, Any]:
    start, rt, shard = time.perf_counter(), run.rt, _shard(run)
    mine = list(shard.mine(len(items)))
    completions = score.greedy_completions(run.engine.lm(run.model), run.tokenizer, [items[i].prompt for i in mine],
                                           max_new_tokens=int(task.max_new_tokens), stop=list(task.stop),
                                           batch_size=int(run.cfg.eval.batch_size),
                                           max_length=int(run.cfg.data.max_length), device=rt.device,
                                           autocast=rt.compute)
    metrics, n = _shares(run, ("exact_match", "contains"), score.generate_tally(items, mine, completions))
    examples = [{"prompt": items[i].prompt, "completion": c, "target": items[i].target}
                for i, c in zip(mine[:task.examples], completions, strict=False)]
    return _record(step, name, "generate", metrics, n, start, examples=examples)


def _harness_tasks(run: Run, manager: Any, step: int) -> list[dict[str, Any]]:
    """The harness's tasks on rank 0 (the only rank with an index); one record per task it reports."""
    start, rt, lm_cfg = time.perf_counter(), run.rt, run.cfg.eval.lm_eval
    with rt.compute():
        results = harness.evaluate(run.engine.lm(run.model), run.tokenizer, manager, list(lm_cfg.tasks),
                                   batch_size=int(lm_cfg.batch_size), max_length=int(run.cfg.data.max_length),
                                   limit=lm_cfg.limit, num_fewshot=lm_cfg.num_fewshot, device=rt.device)
    return [_record(step, task, "lm_eval", metrics, n, start) for task, (metrics, n) in results.items()]
