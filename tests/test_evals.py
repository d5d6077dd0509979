"""Downstream tasks (`eval` group, `llmexp.evals`): task files and their errors, the choice scorer against
lm-evaluation-harness itself, the tasks in the loop (records, summary, report, console), sweep.metric."""

from __future__ import annotations

import json
import math
import random
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from llmexp.errors import UserError
from llmexp.evals import score
from llmexp.evals.items import ChoiceItem, read_choice_items, read_generate_items
from tests.conftest import TINY, Launched, compose, read_metrics, run_cli

MC_ITEMS = [
    {"context": "The capital of France is", "choices": ["Paris", "Berlin", "a small dog"], "answer": 0},
    {"context": "def add(a, b):\n    return ", "choices": ["a + b", "print(a)", "None"], "answer": 0},
    {"context": "One, two, three, ", "choices": ["four", "seven", "blue"], "answer": 0},  # trailing space
    {"context": "", "choices": ["hello world", "zzz qqq"], "answer": 1},  # empty: conditioned on the prefix token
    {"context": "import os\nimport", "choices": [" sys", " json", " re"], "answer": 2},
]


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- task files


def test_task_files_name_the_file_line_and_record(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(MC_ITEMS[0]) + "\n\n{not json\n")
    with pytest.raises(UserError, match=rf"{bad}:3: malformed JSON"):
        read_choice_items(bad, "eval.multiple_choice.x.file")
    bad.write_text(json.dumps(MC_ITEMS[0]) + '\n{"context": "c", "choices": ["a"], "answer": 1' + "0" * 6000 + "}\n")
    with pytest.raises(UserError, match=rf"{bad}:2: a number of more than 4300 digits"):  # not a traceback
        read_choice_items(bad, "eval.multiple_choice.x.file")
    bad.write_bytes(json.dumps(MC_ITEMS[0]).encode() + b'\n{"context": "caf\xe9", "choices": ["a"], "answer": 0}\n')
    with pytest.raises(UserError, match=rf"{bad}:2: it is not UTF-8 text"):  # not read as U+FFFD
        read_choice_items(bad, "eval.multiple_choice.x.file")
    cases = [({"context": "c", "choices": [], "answer": 0}, "`choices` must be a non-empty list"),
             ({"context": "c", "choices": ["a", "b"], "answer": 2}, r"`answer` must be .* in \[0, 1\]"),
             ({"context": "c", "choices": ["a", ""], "answer": 0}, "every choice must be a non-empty string"),
             ({"choices": ["a"], "answer": 0}, "`context` must be a string"),
             (["a"], "a record must be a JSON object")]
    for rec, message in cases:
        path = _jsonl(tmp_path / "one.jsonl", [MC_ITEMS[0], rec])
        with pytest.raises(UserError, match=rf"{path}:2: record 1: {message}"):
            read_choice_items(path, "eval.multiple_choice.x.file")
    with pytest.raises(UserError, match="record 0: `target` is empty"):
        read_generate_items(_jsonl(tmp_path / "g.jsonl", [{"prompt": "p", "target": " "}]), "eval.generate.g.file")
    assert len(read_choice_items(_jsonl(tmp_path / "ok.jsonl", MC_ITEMS), "k", max_items=2)) == 2


def test_a_bad_task_file_exits_2_with_nothing_written(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "mc.jsonl", [MC_ITEMS[0], {"context": "x", "choices": ["a"], "answer": 3}])
    run_dir = tmp_path / "run"
    proc = run_cli([*TINY, f"++eval.multiple_choice={{mc: {{file: '{path}'}}}}", f"hydra.run.dir={run_dir}"],
                   cwd=tmp_path, env={"LLMEXP_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{path}:2: record 1: `answer`" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    assert not run_dir.exists()  # read before the run directory is made (issue 40, task files)


def test_bad_eval_inputs_are_refused_before_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          cli_refusal) -> None:
    """A sweep's task file is read before the sweep directory exists, and the harness's task names (an index of
    `include_path` alone) before the run directory does; a good task folder passes to the launch."""
    monkeypatch.chdir(tmp_path)
    bad = _jsonl(tmp_path / "mc.jsonl", [MC_ITEMS[0], {"context": "x", "choices": ["a"], "answer": 3}])
    code, err = cli_refusal(["--multirun", f"++eval.multiple_choice={{mc: {{file: '{bad}'}}}}", "lr=1e-3,2e-3"])
    assert code == 2 and f"{bad}:2: record 1: `answer`" in err, err
    tasks = _task_dir(tmp_path, _jsonl(tmp_path / "items.jsonl", MC_ITEMS))
    harness = ["eval=lm_eval", f"eval.lm_eval.include_path={tasks}", "eval.lm_eval.include_defaults=false"]
    code, err = cli_refusal([*harness, "eval.lm_eval.tasks=[no_such_task]"])
    assert code == 2 and f"no_such_task not found in {tasks};" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["items.jsonl", "mc.jsonl", "tasks"]
    with pytest.raises(Launched):
        cli_refusal([*harness, "eval.lm_eval.tasks=[llmexp_mc]"])


@pytest.mark.parametrize("damage", ["missing", "malformed"])
def test_a_harness_tasks_data_that_cannot_load_is_the_users_to_fix(damage: str, tmp_path: Path) -> None:
    """A task YAML whose data file is missing or malformed raised at the first eval: a traceback, exit 1."""
    from llmexp.evals import harness

    data = tmp_path / "items.jsonl"
    if damage == "malformed":
        _jsonl(data, MC_ITEMS).write_text(data.read_text() + "{oops\n")
    tasks = _task_dir(tmp_path, data)
    with pytest.raises(UserError, match=r"eval.lm_eval.tasks=llmexp_mc: the harness cannot load their data \("):
        harness.check_task_data(harness.task_manager(str(tasks), False), ["llmexp_mc"])


# ----------------------------------------------------------------------------- the scorer against the harness


def _tiny_lm() -> tuple[Any, Any]:
    """A random-init two-layer Llama and a byte-level BPE tokenizer trained here (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps(r) for r in MC_ITEMS] * 20 + ["import sys, json, re, os", "hello world, Paris Berlin"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(config).eval(), tokenizer


def _task_dir(tmp_path: Path, data: Path) -> Path:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "llmexp_mc.yaml").write_text(
        "task: llmexp_mc\ndataset_path: json\ndataset_kwargs:\n"
        f"  data_files:\n    test: {data}\n  cache_dir: {tmp_path / 'hf_cache'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: context\ndoc_to_choice: choices\n"
        "doc_to_target: answer\ntarget_delimiter: ' '\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    return tasks


def test_choice_log_likelihoods_equal_lm_evaluation_harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 4 of issue 29: on the same items and model, llmexp's per-choice log-likelihoods are the harness's
    (its HFLM on the in-memory model, offline, a task YAML pointing at a local JSONL) to 1e-5 in fp32; the
    adapter (`llmexp.evals.harness`) reports the harness's acc and acc_norm, which equal llmexp's own, and
    touches no RNG."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from llmexp.evals import harness
    from llmexp.model.loss import CausalLMLoss

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm, tok = _tiny_lm()
    data = _jsonl(tmp_path / "items.jsonl", MC_ITEMS)
    manager = harness.task_manager(str(_task_dir(tmp_path, data)), include_defaults=False)
    out = simple_evaluate(model=HFLM(pretrained=lm, tokenizer=tok, batch_size=4, max_length=128),
                          tasks=["llmexp_mc"], task_manager=manager, log_samples=True, bootstrap_iters=0)
    theirs = {(s["doc_id"], j): float(resp[0]) for s in out["samples"]["llmexp_mc"]
              for j, resp in enumerate(s["filtered_resps"])}

    items = [ChoiceItem(r["context"], tuple(r["choices"]), r["answer"]) for r in MC_ITEMS]
    requests = score.choice_requests(tok, items, range(len(items)), " ")
    ours = score.loglikelihoods(CausalLMLoss(lm), requests, batch_size=3, max_length=128,
                                pad_id=tok.pad_token_id, device=torch.device("cpu"), autocast=nullcontext)
    assert len(ours) == len(theirs) == sum(len(i.choices) for i in items)
    for req, ll in zip(requests, ours, strict=True):
        assert ll == pytest.approx(theirs[(req.item, req.choice)], abs=1e-5), (req, ll)
    right, right_norm, n = score.choice_tally(items, requests, ours)

    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    got, scored = harness.evaluate(lm, tok, manager, ["llmexp_mc"], batch_size=4, max_length=128, limit=None,
                                   num_fewshot=None, device=torch.device("cpu"))["llmexp_mc"]
    assert scored == len(items)  # (the task records said 0 items)
    assert torch.equal(states[0], torch.get_rng_state()) and states[1] == random.getstate()
    assert np.array_equal(states[2], np.random.get_state()[1])
    assert got["acc"] == pytest.approx(right / n) and got["acc_norm"] == pytest.approx(right_norm / n)


# ----------------------------------------------------------------------------- the tasks in the loop


@pytest.fixture(scope="module")
def task_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One in-process run with every kind of file task, the demo task and an extra held-out set, evals at
    steps 0, 2 and 4, ranked by a task metric (maximised)."""
    from llmexp.train.train import train

    root = tmp_path_factory.mktemp("tasks")
    mc = _jsonl(root / "mc.jsonl", MC_ITEMS)
    qa = _jsonl(root / "qa.jsonl", [{"prompt": f"def f{i}(", "target": "x"} for i in range(5)])
    words = ["import", "os", "sys", "json", "def", "return", "class", "self", "value", "None", "True", "False"]
    rng = random.Random(0)
    docs = _jsonl(root / "docs.jsonl", [{"text": " ".join(rng.choices(words, k=80))} for _ in range(12)])
    run_dir = root / "run"
    cfg = compose([*TINY, "precision=fp32", "lr=3e-3", "train.max_steps=4", "train.eval_steps=2",
                   "train.save_steps=0", "train.peak_tflops=1", "eval=demo", "eval.demo_items=8",
                   f"++eval.multiple_choice={{mc: {{file: '{mc}'}}}}",
                   f"++eval.generate={{qa: {{file: '{qa}', max_new_tokens: 4, examples: 2}}}}",
                   f"++eval.perplexity={{docs: {{name: json, eval_file: '{docs}'}}}}",
                   "sweep.metric=tasks/mc/acc", "sweep.direction=maximize"], run_dir)
    result = train(cfg)
    return {"run_dir": run_dir, "result": result}


def test_tasks_are_recorded_at_every_eval(task_run: dict[str, Any]) -> None:
    run_dir = task_run["run_dir"]
    assert task_run["result"].status == "completed"
    records = read_metrics(run_dir, "eval_task")
    by_task = {name: [r for r in records if r["task"] == name] for name in ("docs", "mc", "demo", "qa")}
    for name, recs in by_task.items():
        assert [r["step"] for r in recs] == [0, 2, 4], name
    assert all(set(r["metrics"]) == {"acc", "acc_norm"} and r["items"] == len(MC_ITEMS) for r in by_task["mc"])
    assert all(r["items"] == 8 and r["kind"] == "multiple_choice" for r in by_task["demo"])
    assert all(set(r["metrics"]) == {"exact_match", "contains"} and len(r["examples"]) == 2 for r in by_task["qa"])
    assert all(0 <= v <= 1 for name in ("mc", "demo", "qa") for r in by_task[name] for v in r["metrics"].values())
    docs = by_task["docs"]
    assert all(math.isclose(r["metrics"]["ppl"], math.exp(r["metrics"]["loss"])) for r in docs)
    assert all(r["items"] == 2 * 4 for r in docs)  # train.eval_batches=2 batches of 4 (it said the whole set's 12)
    assert docs[-1]["metrics"]["loss"] < docs[0]["metrics"]["loss"]  # the model learns the words it trains on
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tasks"]["mc"]["step"] == 4 and summary["tasks"]["mc"]["acc"] == by_task["mc"][-1]["metrics"]["acc"]
    assert set(summary["tasks"]) == {"docs", "mc", "demo", "qa"}


def test_tasks_reach_the_report_the_curves_and_the_sinks(task_run: dict[str, Any]) -> None:
    from llmexp.monitor.console import format_line
    from llmexp.monitor.records import numbers

    run_dir = task_run["run_dir"]
    report = (run_dir / "report.md").read_text()
    assert "## Tasks" in report and "**mc** (multiple_choice)" in report and "| acc | " in report
    assert "| metric | step 0 | step 2 | step 4 |" in report and "Examples at step 4:" in report
    assert (run_dir / "curves.png").stat().st_size > 10_000
    record = read_metrics(run_dir, "eval_task")[-1]
    assert format_line(record).startswith(f"task      4 | {record['task']} | ")
    assert set(numbers(record)) == {f"tasks/{record['task']}/{m}" for m in record["metrics"]}


# ----------------------------------------------------------------------------- sweep.metric


def test_sweep_metric_must_be_one_the_jobs_record(tmp_path: Path) -> None:
    from llmexp.config.validation import ConfigError, validate

    validate(compose(["eval=demo", "sweep.metric=tasks/demo/acc_norm", "sweep.direction=maximize"], tmp_path))
    for overrides, message in (
            (["sweep.metric=tasks/demo/acc", "sweep.direction=maximize"], "no job records it"),
            (["eval=demo", "sweep.metric=tasks/demo/acc"], "set sweep.direction=maximize"),
            (["eval=demo", "sweep.metric=tasks/demo/f1", "sweep.direction=maximize"], "tasks/demo/acc_norm"),
            (["sweep.direction=up"], "sweep.direction")):
        with pytest.raises(ConfigError, match=message):
            validate(compose(overrides, tmp_path))


def test_a_search_on_a_metric_no_job_records_exits_2_before_any_trial(tmp_path: Path) -> None:
    proc = run_cli(["--multirun", "sweep=tpe", "sweep.n_trials=2", "lr=tag(log,interval(1e-4,1e-2))",
                    "sweep.metric=tasks/demo/acc", "sweep.direction=maximize", f"hydra.sweep.dir={tmp_path / 's'}"],
                   cwd=tmp_path)
    assert proc.returncode == 2 and "sweep.metric=tasks/demo/acc: no job records it" in proc.stderr, proc.stderr
    assert not (tmp_path / "s").exists()


def _fake_job(sweep: Path, n: int, lr: str, eval_loss: float, acc: float, direction: str) -> None:
    import yaml

    job = sweep / str(n)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"lr={lr}"]))
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(
        {"lr": float(lr), "sweep": {"metric": "tasks/demo/acc", "direction": direction}}))
    (job / "summary.json").write_text(json.dumps({"status": "completed", "step": 10, "eval_loss": eval_loss,
                                                  "tasks": {"demo": {"acc": acc, "acc_norm": acc, "step": 10}},
                                                  "findings": []}))
    (job / "metrics.jsonl").write_text(json.dumps({"event": "eval", "step": 10, "eval_loss": eval_loss}) + "\n")


def test_the_grid_recommendation_and_a_search_result_rank_by_the_metric(tmp_path: Path) -> None:
    """The job with the lower eval loss loses when the sweep maximises tasks/demo/acc."""
    from llmexp.report.sweep import write_sweep_report
    from llmexp.sweep.search import read_result

    sweep = tmp_path / "sweep"
    _fake_job(sweep, 0, "1e-3", eval_loss=5.0, acc=0.30, direction="maximize")
    _fake_job(sweep, 1, "3e-4", eval_loss=5.5, acc=0.45, direction="maximize")
    summary = write_sweep_report(sweep)
    rec = summary["recommendation"]
    assert rec["job"] == "1" and rec["metric"] == "tasks/demo/acc" and rec["value"] == pytest.approx(0.45)
    assert "highest final tasks/demo/acc (0.45)" in rec["reason"]
    assert "| tasks/demo/acc |" in (sweep / "sweep_report.md").read_text()
    assert read_result(sweep / "1", "tasks/demo/acc").value == pytest.approx(0.45)
    assert read_result(sweep / "1").value == pytest.approx(5.5)


@pytest.mark.parametrize(("overrides", "message"), [
    (["eval.batch_size=0"], "eval.batch_size: must be in [1, 4096]"),
    (["eval.demo_items=-1"], "eval.demo_items"),
    (["++eval.generate={qa: {file: g.jsonl, max_new_tokens: 0}}"], "eval.generate.qa.max_new_tokens"),
    (["++eval.multiple_choice={mc: {max_items: 2}}"], "eval.multiple_choice.mc.file: names no task file"),
    (["++eval.perplexity={p: {name: jsonl}}"], "eval.perplexity.p.name"),
    # a file on a stdlib run: the set was the run's own eval split, the file never read
    (["++eval.perplexity={p: {eval_file: t.jsonl}}"], "eval.perplexity.p.eval_file: a file is read by data=json or "
     "text, and this set's data is stdlib; set eval.perplexity.p.name=json"),
    (["++eval.multiple_choice={a+b: {file: m.jsonl}}"], "a task name must be"),
    (["eval=lm_eval"], "eval.lm_eval.tasks"),
    (["eval.lm_eval.tasks=[arc_easy]", "fsdp=full_shard"], "generate and lm_eval tasks run on whole weights"),
])
def test_bad_eval_settings_name_the_key(overrides: list[str], message: str, tmp_path: Path) -> None:
    from llmexp.config.validation import ConfigError, validate

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(compose(overrides, tmp_path))
