"""`data.streaming=true` (data=hf): the train split read as training goes, in seeded windows.

Real datasets written by the tests (parquet, save_to_disk), a real BPE tokenizer directory, the real
trainer through the CLI for the kill-and-resume check. Checked: the streamed examples are the cached
path's (the same rows over an epoch; the same tokens for packed text), the order is a function of the
seed and is shuffled only within windows, epochs follow each other, eval rows are never trained on,
resume from a checkpoint's position re-reads at most one window and a SIGKILLed CLI run resumes
bitwise, nothing of the train split reaches the token cache, and each config mistake exits 2.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest

from llmexp.config.validation import ConfigError, validate
from llmexp.data.datasets import build_datasets
from llmexp.data.stream import StreamDataset, build_stream_datasets
from llmexp.data.tokenizer import load_tokenizer, train_bpe
from tests.conftest import TINY, compose, run_cli

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
G = 4


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"doc {i}: " + " ".join(rng.choices(WORDS, k=rng.randint(3, 40))) for i in range(n)]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save_to_disk DatasetDict (train/test, text and prompt/completion columns), the same train rows as
    parquet, and a tokenizer directory."""
    root = tmp_path_factory.mktemp("stream-data")
    train, test = _texts(90), _texts(12, seed=1)
    table = {"text": train, "prompt": [t[:12] for t in train], "completion": [t[12:] for t in train]}
    held = {"text": test, "prompt": [t[:12] for t in test], "completion": [t[12:] for t in test]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(table),
                          "test": datasets.Dataset.from_dict(held)}).save_to_disk(str(root / "dict"))
    datasets.Dataset.from_dict({"body": train}).to_parquet(str(root / "train.parquet"))
    train_bpe(train, 400).save_pretrained(str(root / "tok"))
    return root


def _overrides(*args: str) -> list[str]:
    """TINY, data=hf on the test's DatasetDict, then `args` (which replace TINY's keys)."""
    base = [*TINY, "data=hf", "data.max_length=32", "train.max_steps=10", "data.max_examples=null"]
    keys = {a.split("=", 1)[0] for a in args}
    base = [a for a in base if a.split("=", 1)[0] not in keys and not (a.startswith("data.max_length")
                                                                       and a != "data.max_length=32")]
    return [a for a in base if not a.startswith("data.max_examples=6")] + list(args)


def _cfg(data_dir: Path, tmp_path: Path, *args: str) -> Any:
    return compose(_overrides(f"data.path={data_dir / 'dict'}", f"data.tokenizer={data_dir / 'tok'}", *args),
                   tmp_path / "run")


def _build(cfg: Any) -> tuple[Any, Any]:
    build = build_stream_datasets if cfg.data.streaming else build_datasets  # as the trainer picks
    train, held, _ = build(cfg, load_tokenizer(cfg))
    return train, held


def _rows(ds: Any, idx: np.ndarray) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(input_ids, labels) of each row, the right padding cut off: it ends at the row's last target (a row keeps
    no example without one, and its own tokens run to its end)."""
    batch = ds.get_batch(idx)
    out = []
    for r in range(len(idx)):
        targets = (batch["labels"][r] != -100).nonzero()
        n = int(targets[-1]) + 1 if len(targets) else 0
        out.append((tuple(batch["input_ids"][r, :n].tolist()), tuple(batch["labels"][r, :n].tolist())))
    return out


def _stream_rows(ds: StreamDataset, steps: range, seed: int = 0) -> list[Any]:
    return [row for step in steps for row in _rows(ds, ds.step_indices(seed, step, G))]


@pytest.mark.parametrize("fields", [["data.text_field=text"], ["data.prompt_field=prompt",
                                                              "data.completion_field=completion"]])
def test_an_epoch_of_the_stream_holds_the_cached_rows(data_dir: Path, tmp_path: Path, fields: list[str]) -> None:
    args = [*fields, "data.eval_split=test", "data.packing=false"]
    cached, cached_eval = _build(_cfg(data_dir, tmp_path, *args))
    stream, stream_eval = _build(_cfg(data_dir, tmp_path, *args, "data.streaming=true", "data.shuffle_window=16"))
    assert isinstance(stream, StreamDataset) and len(cached) == 90
    epoch = _stream_rows(stream, range(90 // G))[:88] + _stream_rows(stream, range(22, 23))[:2]
    assert Counter(epoch) == Counter(_rows(cached, np.arange(90)))  # every row once, labels included
    assert _rows(stream_eval, np.arange(12)) == _rows(cached_eval, np.arange(12))


def test_packed_text_is_cut_into_the_same_blocks_of_the_same_tokens(data_dir: Path, tmp_path: Path) -> None:
    args = ["data.text_field=text", "data.eval_split=test", "data.packing=true"]
    cached, _ = _build(_cfg(data_dir, tmp_path, *args))
    stream, _ = _build(_cfg(data_dir, tmp_path, *args, "data.streaming=true", "data.shuffle_window=1000"))
    steps = range(-(-len(cached) // G))
    blocks = np.concatenate([stream.get_batch(stream.step_indices(0, s, G))["input_ids"].numpy() for s in steps])
    assert blocks.shape[1] == 32 and (blocks[:, 0] >= 0).all()
    # One window holds the whole split: its first epoch is a permutation of the documents, cut into full blocks
    # like the cached ones, so the tokens of the first len(cached) blocks are the cached tokens, as a multiset,
    # up to the one partial block each side leaves at the end of the epoch.
    got, want = Counter(blocks[: len(cached)].ravel().tolist()), Counter(np.asarray(cached.ids).tolist())
    assert sum(((got - want) + (want - got)).values()) <= 2 * 32


def test_the_order_is_seeded_shuffled_within_windows_and_epochs_go_on(data_dir: Path, tmp_path: Path) -> None:
    args = ["data.text_field=text", "data.packing=false", "data.stream_eval_rows=10", "data.shuffle_window=8",
            "data.streaming=true"]
    cfg = _cfg(data_dir, tmp_path, *args)
    tok = load_tokenizer(cfg)
    first, again = (build_stream_datasets(cfg, tok)[0] for _ in range(2))
    rows = _stream_rows(first, range(40))  # 160 examples: two epochs of 80 rows
    assert rows == _stream_rows(again, range(40))  # deterministic
    assert rows != _stream_rows(build_stream_datasets(cfg, tok)[0], range(40), seed=1)
    docs = [tok.decode(r[0]).split(":")[0] for r in rows]
    held = {f"doc {i}" for i in range(10)}
    assert not held & set(docs)  # the eval rows are never trained on
    for w in range(10):  # each window of 8 rows is a permutation of rows 10+8w .. 10+8w+7
        assert sorted(docs[8 * w: 8 * w + 8]) == sorted(f"doc {i}" for i in range(10 + 8 * w, 18 + 8 * w))
    assert sorted(docs[:80]) == sorted(docs[80:]) and docs[:80] != docs[80:]  # a new epoch, a new order


def test_resume_from_a_position_reads_at_most_one_window_again(data_dir: Path, tmp_path: Path) -> None:
    args = ["data.text_field=text", "data.packing=true", "data.stream_eval_rows=10", "data.shuffle_window=8",
            "data.streaming=true"]
    stream, _ = _build(_cfg(data_dir, tmp_path, *args))
    rows = _stream_rows(stream, range(60))  # several epochs
    for step in (0, 7, 23, 41):
        stream_at = _stream_rows(stream, range(step))
        assert stream_at == rows[: step * G]
        position = json.loads(json.dumps(stream.position(step, G)))  # a checkpoint stores JSON
        resumed = StreamDataset(stream.spec)
        resumed.restore(position)
        reads: list[int] = []  # the rows of each window read to reach `step`
        real = resumed._rows
        resumed._rows = lambda start, reads=reads, real=real: reads.append(len(got := real(start))) or got
        assert _stream_rows(resumed, range(step, step + 1)) == rows[step * G: step * G + G]
        assert len([n for n in reads if n]) <= 2, f"step {step}: {reads}"  # the window it lies in, maybe the next


def test_streaming_mistakes_are_each_named_with_the_fix(data_dir: Path, tmp_path: Path) -> None:
    hf, tok = f"data.path={data_dir / 'dict'}", f"data.tokenizer={data_dir / 'tok'}"
    cases = {
        "data.streaming": ["data=json", "data.train_file=x.jsonl", tok],
        "train.max_steps": [hf, tok, "train.max_steps=-1"],
        "data.tokenizer": [hf],
        "train.on_anomaly": [hf, tok, "train.on_anomaly=rollback"],
        "data.max_examples": [hf, tok, "data.max_examples=100"],
        "data.mix": [tok, "data.mix=[{path: x}]"],
    }
    for key, args in cases.items():
        cfg = compose(_overrides("data.streaming=true", *args), tmp_path / key)
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        assert str(err.value).count("\n") == 1 and f"  {key}: " in str(err.value), str(err.value)
    validate(compose(_overrides("data.streaming=true", hf, tok), tmp_path / "good"))
    proc = run_cli([*TINY, "data=hf", "data.path=x", "data.streaming=true", "train.max_steps=-1",
                    "train.on_anomaly=rollback", f"hydra.run.dir={tmp_path / 'cli'}"], cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert all(f"{k}: " in proc.stderr for k in ("train.max_steps", "data.tokenizer", "train.on_anomaly"))


@pytest.mark.slow  # three CLI runs: ~20 s each on a busy 2-core machine
def test_a_killed_streaming_run_resumes_bitwise(data_dir: Path, tmp_path: Path) -> None:
    from tests.test_resume import Kill, cli_env, run_once

    args = ["data=hf", "data.path=parquet", f"data.data_files={data_dir / 'train.parquet'}", "data.text_field=body",
            f"data.tokenizer={data_dir / 'tok'}", "data.max_length=32", "data.packing=true", "data.streaming=true",
            "data.shuffle_window=16", "data.stream_eval_rows=10", "train.max_steps=12", "train.eval_steps=6",
            "train.save_steps=4", "precision=fp32", "model.max_position_embeddings=64"]
    env = cli_env(tmp_path / "cache")

    def losses(run_dir: Path) -> list[tuple[int, float, float]]:
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r.get("loss", r.get("eval_loss")), r.get("grad_norm", 0.0)) for r in lines
                if r["event"] in ("train", "eval")]

    code, out = run_once(tmp_path / "whole", args, env)
    assert code == 0, out[-3000:]
    # Killed in the 7th backward (step 7 of 12: past the step-4 save, which lies inside a window with a carry-over).
    code, out = run_once(tmp_path / "killed", args, env, Kill(hook="backward:7"))
    assert code == -9, out[-3000:]
    code, out = run_once(tmp_path / "killed", args, env)
    assert code == 0 and "resuming at step 4" in out, out[-3000:]
    assert losses(tmp_path / "killed") == losses(tmp_path / "whole")
    assert len(losses(tmp_path / "whole")) == 12 + 3
    assert not list((tmp_path / "cache").rglob("tokens/*"))  # the streamed split never reaches the token cache


def test_a_bad_row_found_mid_run_ends_it_failed_and_keeps_its_checkpoints(data_dir: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    """A row only the stream reaches, windows into the run, is a user's mistake found after steps ran: exit 2
    naming the file and the row, and the run says how it ended (summary.json `failed` with the error, the
    doctor's header) and keeps the checkpoints a corrected rerun resumes from."""
    from llmexp.report.doctor import main as doctor
    from llmexp.train.guarded import run_guarded

    rows: list[dict[str, Any]] = [{"text": t} for t in _texts(90)]
    rows[60] = {"text": 5}  # window 3 of 16 rows, after the 10 eval rows
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(data_dir, tmp_path, "data.path=json", f"data.data_files={tmp_path / 'd.jsonl'}", "data.streaming=true",
               "data.shuffle_window=16", "data.stream_eval_rows=10", "train.max_steps=40", "train.save_steps=4")
    assert run_guarded(cfg) == 2
    named = f"json [train] (data.data_files={tmp_path / 'd.jsonl'}): row 60 (epoch 0): `text` must be a string"
    assert named in (err := capsys.readouterr().err), err  # the row's index in the file, not in its window
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"]) == ("failed", 2) and 4 <= summary["step"] < 40, summary
    assert "must be a string" in summary["error"]
    assert (run_dir / "checkpoints" / f"step_{summary['step'] // 4 * 4}").is_dir()  # the last save before it
    assert doctor([str(run_dir)]) == 1
    assert f"status failed ({summary['error']})" in capsys.readouterr().out
