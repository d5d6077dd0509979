"""The data pipeline: corpora, tokenizer, token cache, SFT masking, packing, sampler, bad input.

Real components throughout (Hydra compose, the real stdlib, `tokenizers`, a tiny Llama for the
packing check). The stdlib tokenizer is trained once per session on a 30-file subset with a
512-token vocabulary (`data.max_examples`, `model.vocab_size`) to stay inside the time budget.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmexp.data import corpora
from llmexp.data import datasets as data
from llmexp.data.cache import get_or_build
from llmexp.data.tokenizer import hub_error, load_tokenizer
from llmexp.errors import UserError

TINY = ["model.vocab_size=512", "data.max_length=64", "data.max_examples=30", "data.num_proc=1"]


def compose(cache: Path, *overrides: str) -> Any:
    """The real Hydra composition of the CLI, with the cache in the test's directory."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from llmexp.config.schema import register_configs
    from llmexp.config.tree import conf_dir, register_resolvers

    register_configs()
    register_resolvers()
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return hydra_compose("config", overrides=[*TINY, f"data.cache_dir={cache}", *overrides])


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llmexp_cache")


@pytest.fixture(scope="session")
def tok(session_cache: Path) -> Any:
    """The stdlib BPE of the tiny config, trained once."""
    return load_tokenizer(compose(session_cache))


def entries(cache: Path, kind: str = "tokens") -> list[str]:
    """Everything under <cache>/<kind>, hidden temp dirs included."""
    root = cache / kind
    return sorted(os.listdir(root)) if root.exists() else []


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def json_cfg(cache: Path, train: Path, eval_: Path | None = None, *extra: str) -> Any:
    overrides = ["data=json", f"data.train_file={train}", "data.max_length=64", *extra]
    if eval_ is not None:
        overrides.append(f"data.eval_file={eval_}")
    return compose(cache, *overrides)


def label_text(tok: Any, batch: dict[str, Any], row: int) -> str:
    labels = batch["labels"][row]
    return tok.decode(labels[labels != -100].tolist())


# ---------------------------------------------------------------- stdlib corpus and cache


def test_the_held_out_records_stay_held_out_when_records_are_added_or_reordered() -> None:
    """Records were keyed by position too: one record put in front of a file moved every held-out record into
    training, so eval losses across versions of a file did not compare."""
    from llmexp.data.corpora import split_records

    records = [{"prompt": f"{a} + {b} =", "completion": f" {a + b}"} for a in range(20) for b in range(10)]
    _, held = split_records(records, 0.05)
    _, held_after = split_records([{"prompt": "new", "completion": " x"}, *reversed(records)], 0.05)
    assert held and all(r in held_after for r in held)
    _, twice = split_records([{"text": "same"}] * 40, 0.05)  # copies are told apart, each on its own side
    assert 0 < len(twice) < 40


def test_stdlib_files_exclude_tests_and_split_by_file() -> None:
    files = corpora.stdlib_files()
    assert "os.py" in files and os.path.join("json", "__init__.py") in files
    for rel in files:
        assert not set(Path(rel).parts) & corpora.STDLIB_EXCLUDED_DIRS, rel
    train, held = corpora.split_by_hash(files, 0.05)
    rtrain, rheld = corpora.split_by_hash(list(reversed(files)), 0.05)
    assert set(rtrain) == set(train) and set(rheld) == set(held)  # by name, not by position
    assert not set(train) & set(held) and set(train) | set(held) == set(files)
    assert 0.02 < len(held) / len(files) < 0.1


def test_stdlib_blocks_and_cache_hit(session_cache: Path, tok: Any) -> None:
    assert tok.eos_token_id is not None and tok.pad_token_id is not None and len(tok) <= 512
    cfg = compose(session_cache)
    train, held, stats = data.build_datasets(cfg, tok)
    assert stats["data_mode"] == "lm_packed" and stats["data_train_records"] == 30 and len(held) > 0
    assert train.ids.dtype == np.uint16 and isinstance(train.ids, np.memmap)
    idx = data.batch_indices(0, 0, 4, len(train))
    batch = train.get_batch(idx)
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (4, 64)
    assert (batch["labels"] == batch["input_ids"]).all() and train.num_targets(idx) == 4 * 63
    assert stats["data_train_tokens"] == len(train) * 64 and stats["data_eval_tokens"] > 0
    again_train, _, again = data.build_datasets(cfg, tok)
    assert not stats["data_cache_hit"] or again["data_cache_hit"]
    assert again["data_cache_hit"] and again["data_cache_key"] == stats["data_cache_key"]
    assert np.array_equal(np.asarray(again_train.ids), np.asarray(train.ids))
    assert load_tokenizer(cfg).get_vocab() == tok.get_vocab()  # the cached tokenizer is reused


def test_stdlib_change_invalidates_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The real stdlib cannot be edited, so the stdlib root points at a small copy here.
    root = tmp_path / "lib"
    for i in range(6):
        (root / "pkg").mkdir(parents=True, exist_ok=True)
        (root / "pkg" / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 40)
    (root / "test").mkdir()
    (root / "test" / "test_x.py").write_text("assert False\n")
    monkeypatch.setattr(corpora, "stdlib_root", lambda: root)
    cfg = compose(tmp_path / "cache", "data.max_examples=null", "data.max_length=16", "data.eval_fraction=0.3")
    tok = load_tokenizer(cfg)
    _, _, first = data.build_datasets(cfg, tok)
    assert first["data_train_records"] + first["data_eval_records"] == 6  # test/ is excluded
    _, _, hit = data.build_datasets(cfg, tok)
    assert hit["data_cache_hit"]
    path = root / "pkg" / "mod0.py"
    path.write_text(path.read_text() + "# changed\n")
    _, _, changed = data.build_datasets(cfg, load_tokenizer(cfg))
    assert not changed["data_cache_hit"] and changed["data_cache_key"] != first["data_cache_key"]


# ---------------------------------------------------------------- the sampler


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), step=st.integers(0, 500), micro=st.sampled_from([1, 2, 3]),
       num_examples=st.integers(1, 50))
def test_batch_is_the_same_for_any_world_size_and_split(seed: int, step: int, micro: int, num_examples: int) -> None:
    global_batch = 12 * micro
    batch = data.batch_indices(seed, step, global_batch, num_examples)
    assert np.array_equal(batch, data.batch_indices(seed, step, global_batch, num_examples))
    for world in (1, 2, 3, 4, 6, 12):
        accum = global_batch // (world * micro)
        parts = [data.micro_batch(batch, r, world, m, micro) for m in range(accum) for r in range(world)]
        assert np.array_equal(np.sort(np.concatenate(parts)), np.sort(batch))
        assert all(len(p) == micro for p in parts)


def test_sampler_covers_each_epoch_once_and_resumes() -> None:
    n, g = 10, 4
    stream = np.concatenate([data.batch_indices(7, s, g, n) for s in range(10)])  # 4 epochs
    for epoch in range(4):
        assert sorted(stream[epoch * n:(epoch + 1) * n].tolist()) == list(range(n))
    assert not np.array_equal(stream[:n], stream[n:2 * n])  # a fresh permutation per epoch
    assert np.array_equal(data.batch_indices(7, 6, g, n), stream[24:28])  # resume at step 6: same data
    assert not np.array_equal(data.batch_indices(8, 0, g, n), data.batch_indices(7, 0, g, n))
    with pytest.raises(ValueError):
        data.micro_batch(np.arange(4), 1, 2, 1, 2)


# ---------------------------------------------------------------- the cache is never half-written


def test_interrupted_caching_leaves_nothing(tmp_path: Path, tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": f"row {i} " * 30} for i in range(20)])
    cfg = json_cfg(tmp_path / "cache", train)
    calls = []

    def failing_save(*args: Any) -> None:
        calls.append(args[1])
        if len(calls) == 3:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-write
        real_save(*args)

    real_save = data.save_array
    monkeypatch.setattr(data, "save_array", failing_save)
    with pytest.raises(KeyboardInterrupt):
        data.build_datasets(cfg, tok)
    assert entries(tmp_path / "cache") == []
    monkeypatch.setattr(data, "save_array", real_save)
    _, _, stats = data.build_datasets(cfg, tok)
    assert not stats["data_cache_hit"] and len(entries(tmp_path / "cache")) == 1


def _slow_build(root: str, out: str) -> None:
    def build(tmp: Path) -> dict[str, Any]:
        with open(out, "a") as f:
            f.write("built\n")
        (tmp / "x.txt").write_text("x" * 1000)
        return {"ok": True}

    get_or_build(Path(root), "things", "k1", build)


def test_concurrent_builders_build_once(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_slow_build, args=(str(tmp_path), str(tmp_path / "log"))) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert (tmp_path / "log").read_text() == "built\n"
    assert entries(tmp_path, "things") == ["k1"] and (tmp_path / "things/k1/x.txt").stat().st_size == 1000


def test_stale_temp_dir_of_a_killed_builder_is_removed(tmp_path: Path) -> None:
    stale = tmp_path / "things" / ".k2.tmp-dead"
    stale.mkdir(parents=True)
    (stale / "half.npy").write_bytes(b"\x93NUMPY")
    _, meta, hit = get_or_build(tmp_path, "things", "k2", lambda tmp: {"n": 1})
    assert not hit and meta["n"] == 1 and entries(tmp_path, "things") == ["k2"]


# ---------------------------------------------------------------- a damaged cache entry is a miss, rebuilt


def _damage_by(how: str, path: Path) -> None:
    data_ = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data_[: len(data_) // 2])
    elif how == "flip":  # same size: only the recorded sha256 can tell
        path.write_bytes(data_[:-1] + bytes([data_[-1] ^ 0x01]))
    elif how == "garbage":
        path.write_bytes(b"\x00\xff not what was written \xfe" * 3)
    else:
        path.unlink()


@pytest.mark.parametrize("how", ["truncate", "flip", "garbage", "delete"])
def test_damaged_token_arrays_are_rebuilt_with_a_warning(how: str, tmp_path: Path, tok: Any,
                                                         capfd: pytest.CaptureFixture[str]) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": f"row {i} " * 30} for i in range(20)])
    cfg = json_cfg(tmp_path / "cache", train)
    first, _, stats = data.build_datasets(cfg, tok)
    ids = np.array(first.ids)
    (key,) = entries(tmp_path / "cache")
    _damage_by(how, tmp_path / "cache" / "tokens" / key / "train_ids.npy")
    capfd.readouterr()
    again, _, stats = data.build_datasets(cfg, tok)
    assert not stats["data_cache_hit"] and np.array_equal(np.array(again.ids), ids)
    err = capfd.readouterr().err
    assert "llmexp: warning: the cache entry" in err and "train_ids.npy" in err and "rebuilding it" in err, err
    assert entries(tmp_path / "cache") == [key]  # the same key, rebuilt in place: nothing left behind
    _, _, stats = data.build_datasets(cfg, tok)
    assert stats["data_cache_hit"]


@pytest.mark.parametrize(("name", "how"), [("tokenizer.json", "truncate"), ("tokenizer.json", "garbage"),
                                           ("meta.json", "garbage"), ("tokenizer_config.json", "delete")])
def test_a_damaged_tokenizer_cache_is_rebuilt_with_a_warning(name: str, how: str, tmp_path: Path,
                                                             capfd: pytest.CaptureFixture[str],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": f"word{i % 7} and more {i}"} for i in range(40)])
    cfg = json_cfg(tmp_path / "cache", train)
    vocab = load_tokenizer(cfg).get_vocab()
    (key,) = entries(tmp_path / "cache", "tokenizers")
    _damage_by(how, tmp_path / "cache" / "tokenizers" / key / name)
    capfd.readouterr()
    with caplog.at_level("INFO", logger="llmexp.readers"):
        assert load_tokenizer(cfg).get_vocab() == vocab
    err, said = capfd.readouterr().err, [r.getMessage() for r in caplog.records]
    if name == "meta.json":  # its reader's own line: a cache's miss, at INFO
        assert not err and len(said) == 1 and "meta.json" in said[0] and "the entry is built again" in said[0], said
    else:
        assert "llmexp: warning: the cache entry" in err and "rebuilding it" in err, err
    assert entries(tmp_path / "cache", "tokenizers") == [key]


def test_a_cache_entry_records_its_files(tmp_path: Path) -> None:
    def build(tmp: Path) -> dict[str, Any]:
        (tmp / "a.txt").write_text("hello")
        return {"n": 1}

    entry, meta, hit = get_or_build(tmp_path, "things", "k", build)
    assert not hit and meta["n"] == 1
    assert json.loads((entry / "meta.json").read_text())["files"]["a.txt"][0] == 5  # size, then sha256


def _edit_meta(entry: Path, edit: str) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    if edit == "no stats":
        del meta["stats"]
    elif edit == "stats not a dict":
        meta["stats"] = "x"
    elif edit == "no stats.mode":
        del meta["stats"]["mode"]
    elif edit == "stats without counts":  # (trusted: the header said "? train tokens in ? examples")
        meta["stats"] = {"mode": meta["stats"]["mode"]}
    elif edit == "a size as text":  # (its warning said "train_ids.npy is 848 bytes, 848 were written")
        meta["files"] = {name: [str(size), digest] for name, (size, digest) in meta["files"].items()}
    else:  # the record of the files gone, and a file with it: nothing but the record could tell
        del meta["files"]
        (entry / "train_mask.npy").unlink()
    (entry / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("edit", ["no stats", "stats not a dict", "no stats.mode", "stats without counts",
                                  "a size as text", "no files, no mask"])
def test_an_edited_token_meta_is_a_miss_never_trusted(edit: str, tmp_path: Path, tok: Any,
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", PAIRS)
    cfg = json_cfg(tmp_path / "cache", train, train)
    first, _, _ = data.build_datasets(cfg, tok)
    mask = np.array(first.mask)
    (key,) = entries(tmp_path / "cache")
    _edit_meta(tmp_path / "cache" / "tokens" / key, edit)
    capfd.readouterr()
    again, _, stats = data.build_datasets(cfg, tok)
    assert not stats["data_cache_hit"] and stats["data_mode"] == "padded"
    assert again.mask is not None and np.array_equal(np.array(again.mask), mask)  # the prompts stay unscored
    err = capfd.readouterr().err
    if edit != "a size as text":  # (that one is its reader's miss, said at INFO in the log)
        assert "llmexp: warning: the cache entry" in err and "rebuilding it" in err, err
    assert data.build_datasets(cfg, tok)[2]["data_cache_hit"] and "were written" not in err


def test_a_tokenizer_entry_without_its_files_record_is_rebuilt(tmp_path: Path,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": f"word{i % 7} and more {i}"} for i in range(40)])
    cfg = json_cfg(tmp_path / "cache", train)
    eos = load_tokenizer(cfg).eos_token
    (key,) = entries(tmp_path / "cache", "tokenizers")
    entry = tmp_path / "cache" / "tokenizers" / key
    meta = json.loads((entry / "meta.json").read_text())
    del meta["files"]
    (entry / "meta.json").write_text(json.dumps(meta))
    tok_cfg = json.loads((entry / "tokenizer_config.json").read_text())
    (entry / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "eos_token": None}))
    capfd.readouterr()
    assert load_tokenizer(cfg).eos_token == eos
    err = capfd.readouterr().err
    assert "has no record of its files" in err and "rebuilding it" in err, err


# ---------------------------------------------------------------- SFT records: masking and packing


def real_tokens(ds: Any, idx: np.ndarray, batch: dict[str, Any]) -> Any:
    """(B, L) bool: the rows' own tokens, the right padding False (each row's length from the dataset's offsets)."""
    import torch

    lengths = torch.from_numpy(ds.offsets[idx + 1] - ds.offsets[idx])
    return torch.arange(batch["input_ids"].shape[1]) < lengths[:, None]

PAIRS = [{"prompt": f"Q: what is {i} plus {i}?\nA:", "completion": f" {2 * i}, because {i}+{i}={2 * i}."}
         for i in range(12)]


def test_prompt_completion_loss_on_completion_only(tmp_path: Path, tok: Any) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", PAIRS)
    eval_ = write_jsonl(tmp_path / "eval.jsonl", PAIRS[:3])
    ds, held, stats = data.build_datasets(json_cfg(tmp_path / "cache", train, eval_), tok)
    assert stats["data_mode"] == "padded" and len(ds) == 12 and len(held) == 3
    idx = np.array([3, 10])
    batch = ds.get_batch(idx)
    real = real_tokens(ds, idx, batch)
    for row, i in enumerate(idx):
        assert label_text(tok, batch, row) == PAIRS[i]["completion"] + tok.eos_token
        ids = batch["input_ids"][row][real[row]].tolist()
        assert tok.decode(ids) == PAIRS[i]["prompt"] + PAIRS[i]["completion"] + tok.eos_token
    assert (batch["labels"][~real] == -100).all() and "attention_mask" not in batch  # right padding: none needed
    assert ds.num_targets(idx) == int((batch["labels"][:, 1:] != -100).sum())


def test_messages_plain_template_loss_on_assistant_turns(tmp_path: Path, tok: Any) -> None:
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"},
                         {"role": "assistant", "content": "Bye."}]}
    train = write_jsonl(tmp_path / "train.jsonl", [chat] * 3)
    ds, _, _ = data.build_datasets(json_cfg(tmp_path / "cache", train, train, "data.max_length=128"), tok)
    batch = ds.get_batch(np.array([0]))
    assert label_text(tok, batch, 0) == f"Hello.{tok.eos_token}Bye.{tok.eos_token}"
    assert tok.decode(batch["input_ids"][0].tolist()).startswith("### System:\nBe brief.\n\n### User:\nHi?")


def test_messages_chat_template_loss_on_assistant_turns(tmp_path: Path, tok: Any) -> None:
    templated = tok.__class__.from_pretrained(tok.name_or_path)
    templated.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    chat = {"messages": [{"role": "user", "content": "Ping"}, {"role": "assistant", "content": "Pong"}]}
    train = write_jsonl(tmp_path / "train.jsonl", [chat] * 2)
    ds, _, _ = data.build_datasets(json_cfg(tmp_path / "cache", train, train), templated)
    assert label_text(templated, ds.get_batch(np.array([1])), 0) == "Pong<|end|>"


@pytest.mark.parametrize("template", ["{% for m in messages %}{% if m['role'] == 'system' %}"
                                      "{{ raise_exception('System role not supported') }}{% endif %}"
                                      "{{ m['content'] }}{% endfor %}",
                                      "{% for m in messages %}{{ m['content'] }{% endfor %}"])
def test_a_chat_template_that_fails_is_the_users_mistake(template: str, tmp_path: Path, tok: Any) -> None:
    """A template that refuses a conversation (Gemma's and Mistral's raise on a system turn) or does not parse is
    exit 2 naming the record and the fix, not jinja2's traceback."""
    templated = tok.__class__.from_pretrained(tok.name_or_path)
    templated.chat_template = template
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ping"},
                         {"role": "assistant", "content": "Pong"}]}
    train = write_jsonl(tmp_path / "train.jsonl", [chat] * 2)
    with pytest.raises(UserError, match=r"record 0: the tokenizer's chat template fails on it \(Template"):
        data.build_datasets(json_cfg(tmp_path / "cache", train, train), templated)


def test_jsonl_strings_may_hold_unicode_line_separators(tmp_path: Path) -> None:
    """U+2028, U+2029 and U+0085 are legal raw inside a JSON string (json.dumps(..., ensure_ascii=False) writes
    them); a JSONL line is cut at "\\n" only, as json.loads and HF datasets read it."""
    from llmexp.data.corpora import read_json_records

    texts = ["a\u2028b", "c\u2029d", "e\u0085f"]
    path = tmp_path / "u.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    assert [r["text"] for r in read_json_records(path)] == texts


def test_sft_packing_keeps_examples_apart(tmp_path: Path, tok: Any) -> None:
    """Packed rows give every example exactly the loss it gets alone: attention stops at boundaries."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    train = write_jsonl(tmp_path / "train.jsonl", PAIRS)
    cfg = json_cfg(tmp_path / "cache", train, train, "data.packing=true")
    packed, _, stats = data.build_datasets(cfg, tok)
    padded, _, _ = data.build_datasets(json_cfg(tmp_path / "cache", train, train), tok)
    assert stats["data_mode"] == "sft_packed" and len(packed) < len(padded)
    assert packed.num_targets(np.arange(len(packed))) == padded.num_targets(np.arange(len(padded)))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=64, initializer_range=0.5,  # sharp attention
                                         attn_implementation="sdpa")).eval()

    def loss_sum(batch: dict[str, torch.Tensor]) -> float:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
        return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                                       reduction="sum"))

    with torch.no_grad():
        batch = packed.get_batch(np.arange(len(packed)))
        assert "position_ids" in batch and "attention_mask" not in batch
        alone = loss_sum(padded.get_batch(np.arange(len(padded))))
        assert loss_sum(batch) == pytest.approx(alone, rel=1e-5)
        leaky = {k: v for k, v in batch.items() if k != "position_ids"}  # one long sequence: examples see each other
        assert abs(loss_sum(leaky) - alone) > 1e-3 * alone


def test_trainer_loss_keeps_packed_examples_apart(tmp_path: Path, tok: Any) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmexp.model.loss import CausalLMLoss

    train = write_jsonl(tmp_path / "train.jsonl", PAIRS)
    packed = data.build_datasets(json_cfg(tmp_path / "cache", train, train, "data.packing=true"), tok)[0]
    padded = data.build_datasets(json_cfg(tmp_path / "cache", train, train), tok)[0]
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.5, attn_implementation="sdpa"))
    loss = CausalLMLoss(lm).train()
    with torch.no_grad():
        alone = float(loss(**padded.get_batch(np.arange(len(padded)))))
        assert float(loss(**packed.get_batch(np.arange(len(packed))))) == pytest.approx(alone, rel=1e-5)


def test_sft_packing_refused_where_boundaries_may_leak(tmp_path: Path, tok: Any) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", PAIRS)
    cfg = json_cfg(tmp_path / "cache", train, train, "data.packing=true", "model.trust_remote_code=true",
                   "model.revision=abc")
    with pytest.raises(UserError, match=r"data\.packing=false"):
        data.build_datasets(cfg, tok)
    assert entries(tmp_path / "cache") == []


def test_truncation_is_reported(tmp_path: Path, tok: Any) -> None:
    long = {"prompt": "Q: " + "why " * 10, "completion": " because" * 200}
    train = write_jsonl(tmp_path / "train.jsonl", [long, *PAIRS[:3]])
    ds, _, stats = data.build_datasets(json_cfg(tmp_path / "cache", train, train), tok)
    assert stats["data_train_truncated_examples"] == 1 and stats["data_train_truncated_tokens"] > 100
    assert int(np.diff(ds.offsets).max()) == 64 and stats["data_train_examples"] == 4


def test_stdlib_sft_pairs_hold_out_files(session_cache: Path, tok: Any) -> None:
    files = corpora.stdlib_files()
    held_files = corpora.split_by_hash(files, 0.05)[1]
    pairs = corpora.stdlib_sft_records(["json/__init__.py"], num_proc=1)
    dumps = next(p for p in pairs if p["prompt"].startswith("# json/__init__.py: dumps\n"))
    assert dumps["prompt"].endswith('def dumps(obj, *, skipkeys=False, ensure_ascii=True, check_circular=True, '
                                    'allow_nan=True, cls=None, indent=None, separators=None, default=None, '
                                    'sort_keys=False, **kw):\n    """')
    assert dumps["completion"].startswith("Serialize ``obj`` to a JSON formatted ``str``.")
    cfg = compose(session_cache, "data=stdlib_sft", "data.max_examples=40", "data.max_length=128")
    ds, held, stats = data.build_datasets(cfg, tok)
    assert stats["data_mode"] == "padded" and len(ds) == 40 and len(held) > 10
    batch = held.get_batch(np.arange(4))
    real = real_tokens(held, np.arange(4), batch)
    for row in range(4):
        text = tok.decode(batch["input_ids"][row][real[row]].tolist())
        assert text.split(":", 1)[0][2:] in held_files  # "# <file>: name" -- eval pairs come from held-out files
        assert label_text(tok, batch, row).endswith('"""\n' + tok.eos_token)


def test_text_records_padded_or_packed(tmp_path: Path, tok: Any) -> None:
    rows = [{"text": f"line {i} " * (3 + i)} for i in range(10)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    short_eval = write_jsonl(tmp_path / "eval.jsonl", rows[:1])  # fewer tokens than one block
    padded, _, stats = data.build_datasets(json_cfg(tmp_path / "cache", train, short_eval), tok)
    batch = padded.get_batch(np.array([0, 9]))
    assert stats["data_mode"] == "padded" and "attention_mask" not in batch
    real = real_tokens(padded, np.array([0, 9]), batch)
    assert (batch["labels"][real] == batch["input_ids"][real]).all() and (batch["labels"][~real] == -100).all()
    assert tok.decode(batch["input_ids"][0][real[0]].tolist()) == rows[0]["text"] + tok.eos_token
    packed, held, stats = data.build_datasets(json_cfg(tmp_path / "cache", train, short_eval, "data.packing=true"), tok)
    assert stats["data_mode"] == "lm_packed" and packed.block == 64 and stats["data_train_dropped_tokens"] < 64
    assert len(held) == 1 and held.get_batch(np.array([0]))["input_ids"].shape[1] < 64  # eval keeps its short tail


# ---------------------------------------------------------------- text files


def test_text_directory_glob_and_single_file(tmp_path: Path, tok: Any) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(8):
        (docs / f"d{i}.txt").write_text(f"document {i}\n" + "some words here\n" * 20)
    by_dir = compose(tmp_path / "c", "data=text", f"data.train_file={docs}", "data.max_length=32")
    _, dir_eval, dir_stats = data.build_datasets(by_dir, tok)
    _, _, glob_stats = data.build_datasets(compose(tmp_path / "c", "data=text", f"data.train_file={docs}/d*.txt",
                                                   "data.max_length=32"), tok)
    assert dir_stats["data_mode"] == "lm_packed" and glob_stats["data_cache_hit"]  # same files, same key
    assert dir_stats["data_train_records"] + dir_stats["data_eval_records"] == 8 and len(dir_eval) >= 1
    single = compose(tmp_path / "c", "data=text", f"data.train_file={docs}/d0.txt", "data.max_length=16",
                     "data.eval_fraction=0.2")
    _, held, stats = data.build_datasets(single, tok)
    assert stats["data_train_records"] == stats["data_eval_records"] == 1 and len(held) >= 1


def test_changed_user_file_invalidates_cache(tmp_path: Path, tok: Any) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", PAIRS)
    cfg = json_cfg(tmp_path / "cache", train, train)
    first = data.build_datasets(cfg, tok)[2]
    assert data.build_datasets(cfg, tok)[2]["data_cache_hit"]
    stat = train.stat()
    train.write_text(train.read_text().replace("plus", "PLUS"))  # same size, same mtime: content decides
    os.utime(train, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = data.build_datasets(cfg, tok)[2]
    assert not second["data_cache_hit"] and second["data_cache_key"] != first["data_cache_key"]


# ---------------------------------------------------------------- bad input: clear errors, no half cache

BAD_INPUTS = {
    "malformed_line": ('{"text": "ok"}\n{"text": "fine"}\n{"text": broken}\n', r"train\.jsonl:3: malformed JSON"),
    "malformed_list": ('[\n {"text": "ok"},\n {"text": }\n]\n', r"train\.jsonl:3: malformed JSON"),
    "unknown_fields": ('{"text": "ok"}\n{"question": "q", "answer": "a"}\n',
                       r"train\.jsonl:2: record 1: .*none of the known fields; expected `text`, `prompt` \+ "
                       r"`completion`, or `messages`.*found: answer, question"),
    "prompt_only": ('{"prompt": "p"}\n', r"record 0: .*`completion` is missing"),
    "no_assistant": ('{"messages": [{"role": "user", "content": "hi"}]}\n', r"no assistant turn"),
    "bad_role": ('{"messages": [{"role": "robot", "content": "hi"}]}\n', r"messages\[0\] must be"),
    "not_an_object": ('["just", "strings"]\n', r"record 0: a record must be a JSON object"),
    "empty": ("", r"data\.train_file=.*train\.jsonl: the file is empty"),
    "blank": ("\n  \n", r"the file is empty"),
    "single_record": ('{"text": "only one"}\n', r"has 1 record\(s\); cannot hold out an eval set"),
    # nested past Python's recursion limit: json.loads raises RecursionError, not JSONDecodeError
    "deep_line": ('{"text": "ok"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
                  r"train\.jsonl:2: JSON nested too deeply to parse"),
    "deep_list": ("[" + "[" * 100_000 + "]" * 100_000 + "]\n", r"train\.jsonl: JSON nested too deeply to parse"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_json_input_is_a_clear_user_error(case: str, tmp_path: Path, tok: Any) -> None:
    content, message = BAD_INPUTS[case]
    train = tmp_path / "train.jsonl"
    train.write_text(content, encoding="utf-8")
    with pytest.raises(UserError, match=message):
        data.build_datasets(json_cfg(tmp_path / "cache", train), tok)
    assert entries(tmp_path / "cache") == []


def test_bad_input_while_training_the_tokenizer_leaves_no_cache(tmp_path: Path) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text('{"text": "a"}\n{"text": "b"}\n{oops\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"train\.jsonl:3"):
        load_tokenizer(json_cfg(tmp_path / "cache", train))
    assert entries(tmp_path / "cache", "tokenizers") == [] and entries(tmp_path / "cache") == []


def test_missing_files_and_unusable_eval(tmp_path: Path, tok: Any) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", PAIRS)
    with pytest.raises(UserError, match=r"data\.train_file=.*nope\.jsonl: no such file"):
        data.build_datasets(json_cfg(tmp_path / "cache", tmp_path / "nope.jsonl"), tok)
    with pytest.raises(UserError, match=r"data\.eval_file=.*gone\.jsonl: no such file"):
        data.build_datasets(json_cfg(tmp_path / "cache", train, tmp_path / "gone.jsonl"), tok)
    too_long = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "word " * 200, "completion": " x"}] * 2)
    with pytest.raises(UserError, match=r"data\.eval_file=.*eval\.jsonl has no usable records: 2 record\(s\), 2 left "
                                        r"without a target token after truncation to data\.max_length=64"):
        data.build_datasets(json_cfg(tmp_path / "cache", train, too_long), tok)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(UserError, match=r"matches no non-empty files"):
        data.build_datasets(compose(tmp_path / "cache", "data=text", f"data.train_file={tmp_path}/empty_dir"), tok)
    assert entries(tmp_path / "cache") == []


def test_empty_or_short_data_errors_suggest_the_fix_that_applies(tmp_path: Path, tok: Any) -> None:
    pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    empty = tmp_path / "empty.json"
    empty.write_text("[]", encoding="utf-8")
    with pytest.raises(UserError) as err:  # an eval file of its own: data.eval_fraction does not apply
        data.build_datasets(json_cfg(tmp_path / "cache", pairs, empty), tok)
    assert f"data.eval_file={empty} is empty; add records to it" in str(err.value)
    with pytest.raises(UserError) as err:
        data.build_datasets(json_cfg(tmp_path / "cache", empty, pairs), tok)
    assert f"data.train_file={empty} is empty; add records to it" in str(err.value)
    assert "eval_fraction" not in str(err.value)
    short = write_jsonl(tmp_path / "short.jsonl", [{"text": "one two three"}])  # less than one packed block
    with pytest.raises(UserError) as err:
        data.build_datasets(json_cfg(tmp_path / "cache", short, short, "data.packing=true"), tok)
    assert re.search(rf"data\.train_file={short} has no usable records: its 1 record\(s\) hold [1-9]\d* token\(s\), "
                     r"fewer than one block of data\.max_length=64\. Lower data\.max_length or add data$",
                     str(err.value)), err.value
    assert entries(tmp_path / "cache") == []


def test_hub_names_offline_and_local_model_dirs(tmp_path: Path, tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmexp.data import tokenizer as tokenizer_lib
    # This machine has no route to the hub; forcing the offline branch keeps the test the same where one exists.
    monkeypatch.setattr(tokenizer_lib, "hub_reachable", lambda: False)
    with pytest.raises(UserError, match=r"cannot load 'no-such-org/no-such-model'.*model\.name_or_path=/path/to/"):
        load_tokenizer(compose(tmp_path, "model.name_or_path=no-such-org/no-such-model"))
    with pytest.raises(UserError, match=r"model\.name_or_path=\./missing/model is not a directory.*model/ of an"):
        load_tokenizer(compose(tmp_path, "model.name_or_path=./missing/model"))
    with pytest.raises(UserError, match=r"data\.tokenizer=.* holds no loadable"):
        load_tokenizer(compose(tmp_path, f"data.tokenizer={tmp_path}"))
    tok.save_pretrained(str(tmp_path / "model"))  # what a run's model/ holds
    loaded = load_tokenizer(compose(tmp_path, f"model.name_or_path={tmp_path / 'model'}"))
    assert loaded.get_vocab() == tok.get_vocab() and loaded.pad_token_id == tok.pad_token_id
    assert hub_error("org/name").args[0].startswith("cannot load 'org/name'")


@pytest.mark.parametrize("text", ["", "\n\n", "  first\nsecond", "x" * 500])
def test_an_error_without_text_or_with_pages_of_it_is_quoted_by_its_first_line(text: str) -> None:
    """A library's exception may carry no text (transformers raises bare OSErrors) or pages of it: the one-line
    message quotes its first line, and never fails on the quoting (it once raised IndexError on an empty one)."""
    from llmexp.errors import first_line

    quoted = first_line(OSError(text)) if text else first_line(OSError())
    assert quoted == (text.strip().splitlines() or [""])[0][:200] and "\n" not in quoted
    message = hub_error("./missing/model", OSError(text) if text else OSError()).args[0]
    assert message.startswith(f"model.name_or_path=./missing/model is not a directory (OSError: {quoted})")


# ---------------------------------------------------------------- through the CLI

TINY_MODEL = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
              "model.num_key_value_heads=2", "model.intermediate_size=128", "batch_size=8"]


def cli(tmp_path: Path, cache: Path, *overrides: str) -> Any:
    import subprocess
    import sys

    env = {**os.environ, "LLMEXP_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "llmexp", *overrides], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


def test_sft_demo_requires_a_model(tmp_path: Path, session_cache: Path) -> None:
    cfg = compose(session_cache, "experiment=sft_demo")
    assert cfg.data.name == "stdlib_sft" and cfg.data.finetune_only and cfg.model.name_or_path is None
    with pytest.raises(UserError, match=r"experiment=sft_demo\) fine-tunes an earlier model: set model\.name_or_path"):
        load_tokenizer(cfg)


def test_cli_malformed_line_exits_2_naming_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c",}\n', encoding="utf-8")
    result = cli(tmp_path, tmp_path / "cache", "data=json", "data.train_file=train.jsonl", "data.max_length=64",
                 "train.max_steps=2")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "train.jsonl:3: malformed JSON" in result.stderr and "Traceback" not in result.stderr
    assert entries(tmp_path / "cache", "tokenizers") == [] and entries(tmp_path / "cache") == []


def test_cli_deeply_nested_line_exits_2_naming_file_and_line(tmp_path: Path) -> None:
    deep = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (tmp_path / "train.jsonl").write_text(f'{{"text": "a"}}\n{{"text": "b"}}\n{deep}\n', encoding="utf-8")
    result = cli(tmp_path, tmp_path / "cache", "data=json", "data.train_file=train.jsonl", "data.max_length=64",
                 "train.max_steps=2")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "train.jsonl:3: JSON nested too deeply" in result.stderr and "Traceback" not in result.stderr
    assert entries(tmp_path / "cache", "tokenizers") == [] and entries(tmp_path / "cache") == []


@pytest.mark.slow
def test_sft_demo_fine_tunes_a_default_run(tmp_path: Path, session_cache: Path) -> None:
    """Pretrain a tiny model on the stdlib, then experiment=sft_demo on its model/: held-out eval loss falls."""
    base = cli(tmp_path, session_cache, *TINY, *TINY_MODEL, "train.max_steps=30", "train.eval_steps=30",
               "train.eval_batches=2", "train.save_steps=0", "lr=3e-3", f"hydra.run.dir={tmp_path}/base")
    assert base.returncode == 0, base.stderr[-3000:]
    sft = cli(tmp_path, session_cache, "experiment=sft_demo", f"model.name_or_path={tmp_path}/base/model",
              "data.max_examples=400", "data.max_length=64", "batch_size=8", "train.max_steps=20",
              "train.eval_steps=10", "train.eval_batches=6", f"hydra.run.dir={tmp_path}/sft")
    assert sft.returncode == 0, sft.stderr[-3000:]
    evals = [json.loads(line) for line in (tmp_path / "sft/metrics.jsonl").read_text().splitlines()]
    evals = [e["eval_loss"] for e in evals if e["event"] == "eval"]
    assert len(evals) >= 2 and evals[-1] < evals[0] - 0.1, evals


def test_a_token_meta_whose_files_record_was_emptied_is_a_miss_never_trusted(
        tmp_path: Path, tok: Any, capfd: pytest.CaptureFixture[str]) -> None:
    """`"files": {}` records nothing, as a missing record does: the SFT mask deleted beside it is not trusted away
    (the prompts would be trained on); the entry is rebuilt, with a warning."""
    train = write_jsonl(tmp_path / "train.jsonl", PAIRS)
    cfg = json_cfg(tmp_path / "cache", train, train)
    first, _, _ = data.build_datasets(cfg, tok)
    mask = np.array(first.mask)
    (key,) = entries(tmp_path / "cache")
    entry = tmp_path / "cache" / "tokens" / key
    meta = json.loads((entry / "meta.json").read_text())
    (entry / "meta.json").write_text(json.dumps({**meta, "files": {}}))
    (entry / "train_mask.npy").unlink()
    capfd.readouterr()
    again, _, stats = data.build_datasets(cfg, tok)
    assert not stats["data_cache_hit"]
    assert again.mask is not None and np.array_equal(np.array(again.mask), mask)
    err = capfd.readouterr().err
    assert "the cache entry" in err and "records no files" in err and "rebuilding it" in err, err
    assert data.build_datasets(cfg, tok)[2]["data_cache_hit"]


def test_records_too_short_to_train_on_are_not_told_to_raise_max_length(tmp_path: Path, tok: Any) -> None:
    """Empty texts were 'left without a target token after truncation ... raise data.max_length', which cannot help."""
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": ""}] * 20)
    with pytest.raises(UserError, match=r"20 too short to train on .*\. Add data$"):
        data.build_datasets(json_cfg(tmp_path / "cache", train, train), tok)
