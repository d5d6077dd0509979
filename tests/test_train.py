"""The default run end to end through the CLI, and the saved model reloads with the same eval loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY, compose, read_metrics, run_cli


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m llmexp` with its defaults (tiny model, stdlib corpus), only shortened: 20 steps (the most
    expensive run of the suite's quick files; 20 are enough for every check below, the eval loss falls by
    ~1.5 in them)."""
    root = tmp_path_factory.mktemp("default")
    run_dir = root / "run"
    # A fresh matplotlib config dir: matplotlib rebuilds its font cache and logs "generated new fontManager"
    # at INFO, the third-party line that must stay out of the console.
    proc = run_cli(["train.max_steps=20", "train.eval_steps=10", "train.eval_batches=4", "train.save_steps=10",
                    f"hydra.run.dir={run_dir}"], env={"MPLCONFIGDIR": str(root / "mpl")})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"completed: {run_dir}" in proc.stderr
    (root / "stdout.txt").write_text(proc.stdout)
    (root / "stderr.txt").write_text(proc.stderr)
    return run_dir


@pytest.mark.slow
def test_default_run_writes_the_whole_run_directory(default_run: Path) -> None:
    for name in (".hydra/config.yaml", ".hydra/overrides.yaml", "metrics.jsonl", "summary.json",
                 "model/config.json", "model/model.safetensors", "model/tokenizer.json", "report.md", "curves.png"):
        assert (default_run / name).is_file(), name
    assert [p.name for p in sorted((default_run / "checkpoints").iterdir())] == ["step_10", "step_20"]
    summary = json.loads((default_run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 20
    for key in ("train_loss", "eval_loss", "eval_ppl", "tokens_per_sec", "mfu", "findings"):
        assert key in summary
    (start,) = read_metrics(default_run, "start")  # the data's counts, as docs/reference/metrics.md says (`data_*`)
    data = {k: v for k, v in start.items() if k.startswith("data_")}
    assert data and all(summary[k] == v for k, v in data.items()) and len(summary["data_cache_key"]) > 3
    # data=stdlib brings the default run's pretraining lr (llmexp/conf/data/stdlib.yaml), not lr=auto's 3e-4
    assert summary["lr_source"] == "data" and summary["lr"] == pytest.approx(6e-4)
    assert not [f for f in summary["findings"] if f["severity"] == "error"]


@pytest.mark.slow
def test_default_run_metrics_follow_the_contract(default_run: Path) -> None:
    evals = read_metrics(default_run, "eval")
    assert [e["step"] for e in evals] == [0, 10, 20]  # at step 0, every eval_steps, and at the end
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 1.0
    train = read_metrics(default_run, "train")
    assert [r["step"] for r in train] == [10, 20]  # every logging_steps=10
    for record in train:
        assert {"loss", "ppl", "lr", "grad_norm", "tokens_per_sec", "mfu", "mem_mb"} <= record.keys()
        assert record["ppl"] == pytest.approx(torch.tensor(record["loss"]).exp().item(), rel=1e-5)


@pytest.mark.slow
def test_every_field_the_run_writes_is_in_the_metrics_reference(default_run: Path) -> None:
    """docs/reference/metrics.md, written by hand, cannot fall behind what a run records (issue 39)."""
    reference = (Path(__file__).parents[1] / "docs" / "reference" / "metrics.md").read_text()
    records = [json.loads(line) for line in (default_run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((default_run / "summary.json").read_text())
    fields = {(r["event"], k) for r in records for k in r} | {("summary.json", k) for k in summary}
    missing = sorted(f"{where}: {k}" for where, k in fields if f"`{k}`" not in reference)
    assert not missing, f"add these to docs/reference/metrics.md: {missing}"


@pytest.mark.slow
def test_saved_model_reloads_with_the_same_eval_loss(default_run: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmexp.data import datasets as data
    from llmexp.model.loss import CausalLMLoss

    cfg = compose(["train.eval_batches=4"], tmp_path)
    lm = AutoModelForCausalLM.from_pretrained(default_run / "model")
    tokenizer = AutoTokenizer.from_pretrained(default_run / "model")
    _, eval_ds, _ = data.build_datasets(cfg, tokenizer)
    model = CausalLMLoss(lm).eval()
    total, count = 0.0, 0
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[json.loads((default_run / "summary.json").read_text())[
        "precision"]]  # precision=auto: bf16 on a CPU with native bf16, else fp32
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        for start in range(0, min(len(eval_ds), 4 * cfg.batch_size), cfg.batch_size):
            idx = torch.arange(start, min(start + cfg.batch_size, len(eval_ds))).numpy()
            total += model(**eval_ds.get_batch(idx)).float().item()
            count += eval_ds.num_targets(idx)
    final = read_metrics(default_run, "eval")[-1]["eval_loss"]
    assert total / count == pytest.approx(final, rel=1e-4)


@pytest.mark.slow
def test_console_opens_with_a_header_stays_clean_and_is_kept_in_llmexp_log(default_run: Path) -> None:
    stderr = (default_run.parent / "stderr.txt").read_text()
    stdout = (default_run.parent / "stdout.txt").read_text()
    summary = json.loads((default_run / "summary.json").read_text())
    head = stderr[:stderr.index("eval      0")]
    for expected in (f"run        {default_run}", "model      tiny: LlamaForCausalLM, from scratch\n",
                     f"           {summary['num_params'] / 1e6:.1f}M parameters; vocabulary 8,192, context 256\n",
                     "train tokens in", "eval tokens",
                     "steps      20; global batch 4 = 4 per device x 1 process(es) x 1 accumulation step(s)",
                     f"precision  {summary['precision']} (precision=auto)",
                     f"optimizer  adamw, lr {summary['lr']:.2e} (", "), cosine schedule"):
        assert expected in head, (expected, head)
    assert "cache hit" in head or "tokenised now" in head
    assert "eta " in stderr and "remaining steps" in stderr
    assert "[INFO]" not in stdout + stderr and "fontManager" not in stdout + stderr  # no third-party INFO lines
    log = (default_run / "llmexp.log").read_text()
    assert "generated new fontManager" in log  # it did happen, and the job log keeps it
    for line in ("run        ", "eval      0 | eval_loss", "step     20 | loss", f"completed: {default_run}"):
        assert line in log, line  # the console log


def test_rerunning_a_finished_run_says_there_is_nothing_to_train(tmp_path: Path) -> None:
    """The same command again resumes at train.max_steps and trains no step: no throughput of 0, but the reason."""
    args = [*TINY, "train.max_steps=1", "train.eval_steps=100", f"hydra.run.dir={tmp_path / 'run'}"]
    first = run_cli(args, env={"LLMEXP_CACHE": str(tmp_path / "cache")})
    assert first.returncode == 0 and "tokens_per_sec=" in first.stderr, first.stderr[-2000:]
    again = run_cli(args, env={"LLMEXP_CACHE": str(tmp_path / "cache")})
    assert again.returncode == 0, again.stderr[-2000:]
    assert "tokens_per_sec" not in again.stderr.split("completed: ")[-1], again.stderr[-2000:]
    assert ("nothing to train: the run was already at its last step (1); raise train.max_steps to train on"
            in again.stderr), again.stderr[-2000:]


def test_epochs_shorter_than_one_global_batch_are_refused(tmp_path: Path) -> None:
    """One epoch of 5,930 examples at a global batch of 8,000 trained one step, 1.35 epochs, without a word."""
    from llmexp.errors import UserError
    from llmexp.train.train import train

    cfg = compose([*TINY, "train.max_steps=-1", "train.num_train_epochs=1", "train.gradient_accumulation_steps=4096"],
                  tmp_path / "run")
    with pytest.raises(UserError, match=r"train.num_train_epochs=1(\.0)? of this data is [\d,]+ examples, fewer "
                                        r"than one global batch of 16,384: its one step would train past them"):
        train(cfg)
