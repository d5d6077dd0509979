"""`model.gguf_file`: a llama.cpp GGUF file as a model source (llmexp.machine.gguf, llmexp.data.gguf,
llmexp.model.gguf). The files are written here with the `gguf` package: a tiny Llama with a byte-level BPE, and
headers that must be refused (empty, not GGUF, truncated, an architecture transformers cannot load)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from llmexp.config.validation import ConfigError, validate
from llmexp.machine.gguf import gguf_file_problem, loadable_architectures, read_architecture
from tests.conftest import compose, read_metrics, run_cli

gguf = pytest.importorskip("gguf")
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2


def write_gguf(path: Path, architecture: str = "llama") -> Path:
    """A tiny random Llama as llama.cpp lays it out (F32 tensors), with llmexp's byte-level BPE as a gpt2 tokenizer."""
    from llmexp.data.tokenizer import train_bpe

    tok = train_bpe([f"def f{i}(x):\n    return x * {i}\n" for i in range(200)], 300)
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    eos = model["vocab"]["<|endoftext|>"]
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("llmexp test llama")
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))

    kv = KV_HEADS * HIDDEN // HEADS
    tensor("token_embd.weight", len(tokens), HIDDEN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for b in range(LAYERS):
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(f"blk.{b}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (kv, HIDDEN)), ("attn_v", (kv, HIDDEN)),
                            ("attn_output", (HIDDEN, HIDDEN)), ("ffn_gate", (INTERMEDIATE, HIDDEN)),
                            ("ffn_up", (INTERMEDIATE, HIDDEN)), ("ffn_down", (HIDDEN, INTERMEDIATE))):
            tensor(f"blk.{b}.{name}.weight", *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


def test_the_header_reader_finds_the_architecture_and_refuses_what_is_not_gguf(tiny_gguf: Path,
                                                                              tmp_path: Path) -> None:
    assert read_architecture(tiny_gguf) == "llama"
    assert gguf_file_problem(tiny_gguf) is None
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "model.safetensors.gguf").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    (tmp_path / "cut.gguf").write_bytes(tiny_gguf.read_bytes()[:30])
    data = tiny_gguf.read_bytes()
    (tmp_path / "half.gguf").write_bytes(data[:len(data) // 2])  # a download cut in half: its tensors end early
    reader = gguf.GGUFReader(tiny_gguf)
    field = reader.tensors[0].field
    at = field.offset + sum(int(part.nbytes) for part in field.parts[:4])  # the first tensor's type
    for name, kind in (("unknown-type.gguf", 99), ("q8_1.gguf", gguf.GGMLQuantizationType.Q8_1)):
        (tmp_path / name).write_bytes(data[:at] + struct.pack("<I", kind) + data[at + 4:])
    # a header whose one metadata value nests 5,000 arrays (it took Python's recursion limit, naming no file)
    nested = struct.pack("<Q", 9) + b"general.x" + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000
    (tmp_path / "deep.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + nested + struct.pack("<IQI", 4, 1, 0))
    expected = {"missing.gguf": "no such file", "empty.gguf": "is empty",
                "model.safetensors.gguf": "it is not a GGUF file (it starts with b'\\x08\\x00\\x00\\x00', not "
                                          "b'GGUF')",
                "cut.gguf": "cut.gguf: it is damaged or cut short",
                "half.gguf": "half.gguf: it is damaged or cut short",
                "unknown-type.gguf": "(99) is not a valid GGMLQuantizationType",
                "q8_1.gguf": "its tensors of type Q8_1 cannot be dequantised",
                "deep.gguf": "deep.gguf: its header is damaged (metadata nested too deeply to read)"}
    for name, says in expected.items():
        problem = gguf_file_problem(tmp_path / name)
        assert problem is not None and problem.startswith("model.gguf_file: ") and says in problem, problem


def test_an_architecture_transformers_cannot_load_is_named_with_the_ones_it_can(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "rwkv.gguf", architecture="rwkv7")
    problem = gguf_file_problem(path)
    known = loadable_architectures()
    assert "llama" in known and "qwen2" in known and "tokenizer" not in known and "t5" not in known
    assert problem is not None and "holds a 'rwkv7' model" in problem and f"it loads {', '.join(known)}" in problem


def test_the_key_is_checked_with_the_config(tmp_path: Path) -> None:
    def errors(overrides: list[str]) -> str:
        with pytest.raises(ConfigError) as err:
            validate(compose(overrides, tmp_path))
        return str(err.value)

    assert "model.gguf_file: x.gguf is a file inside a model directory" in errors(["model.gguf_file=x.gguf"])
    assert "model.gguf_file: is empty" in errors(["model.name_or_path=/m", "model.gguf_file=''"])
    assert "a GGUF base is already quantised" in errors(["model.name_or_path=/m", "model.gguf_file=x.gguf",
                                                         "peft=qlora"])
    validate(compose(["model.name_or_path=/m", "model.gguf_file=x.gguf", "peft=lora"], tmp_path))


@pytest.mark.parametrize("content", [None, b"", b"not a model"])
def test_a_missing_empty_or_foreign_file_exits_2_naming_the_key(content: bytes | None, tmp_path: Path) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    if content is not None:
        (directory / "x.gguf").write_bytes(content)
    result = run_cli([f"model.name_or_path={directory}", "model.gguf_file=x.gguf", f"hydra.run.dir={tmp_path / 'r'}"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "model.gguf_file: " in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "r").exists()  # refused before a run directory was made


def _train(directory: Path, run_dir: Path, *extra: str) -> Any:
    """`python -m llmexp` on the GGUF file: 3 steps of fine-tuning on the stdlib."""
    result = run_cli([f"model.name_or_path={directory}", "model.gguf_file=tiny-llama.F32.gguf", "precision=fp32",
                      "data.max_length=32", "data.max_examples=40", "batch_size=4", "train.max_steps=3",
                      "train.eval_steps=3", "train.eval_batches=1", "train.save_steps=0", "train.logging_steps=1",
                      "lr=1e-3", *extra, f"hydra.run.dir={run_dir}"], env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_a_gguf_file_trains_and_model_is_plain_safetensors(tiny_gguf: Path, tmp_path: Path) -> None:
    """End to end: dequantised once (cached), trained, `model/` written as ordinary safetensors that
    `from_pretrained` loads; the header names the file; a second run reuses the conversion."""
    import transformers as tf

    result = _train(tiny_gguf.parent, tmp_path / "run")
    assert f"model      {tiny_gguf}: LlamaForCausalLM, from GGUF dequantised to fp32, fine-tuning" in result.stderr
    assert "Converting and de-quantizing" not in result.stderr  # transformers' bar stays out of the console
    start = read_metrics(tmp_path / "run", "start")[0]
    assert start["model_id"] == str(tiny_gguf) and start["gguf_dtype"] == "fp32"
    model_dir = tmp_path / "run" / "model"
    assert (model_dir / "model.safetensors").is_file() and not list(model_dir.glob("*.gguf"))
    reloaded = tf.AutoModelForCausalLM.from_pretrained(model_dir)
    assert getattr(reloaded.config, "quantization_config", None) is None and not getattr(reloaded, "hf_quantizer", None)
    original = tf.AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(reloaded.state_dict()[name], original.state_dict()[name])  # trained
    tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer("def f3(x):")["input_ids"] == tf.AutoTokenizer.from_pretrained(
        str(tiny_gguf.parent), gguf_file=tiny_gguf.name)("def f3(x):")["input_ids"]
    from llmexp.model.gguf import gguf_model_dir

    cfg = compose([f"model.name_or_path={tiny_gguf.parent}", f"model.gguf_file={tiny_gguf.name}"], tmp_path / "c")
    conversions = sorted((Path(cfg.data.cache_dir) / "models").glob("gguf-*"))
    assert len(conversions) == 1 and json.loads((conversions[0] / "meta.json").read_text())["dtype"] == "float32"
    made = (conversions[0] / "meta.json").stat().st_mtime_ns
    assert gguf_model_dir(cfg, torch.float32) == conversions[0]  # a later run finds it: nothing converted again
    assert (conversions[0] / "meta.json").stat().st_mtime_ns == made


def test_a_cached_gguf_tokenizer_that_cannot_be_loaded_is_rebuilt(tiny_gguf: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """An entry whose bytes still match its recorded hashes but which the tokenizer library cannot read (one
    written by another transformers) is a cache miss: warned about and converted again, never trusted."""
    from llmexp.data.cache import COMPLETE_MARKER, FILES_KEY
    from llmexp.data.gguf import gguf_tokenizer
    from llmexp.rundir.readers import file_sha256

    cfg = compose([f"model.name_or_path={tiny_gguf.parent}", f"model.gguf_file={tiny_gguf.name}"], tmp_path)
    expected = gguf_tokenizer(cfg)("def f3(x):")["input_ids"]
    entry = next((Path(cfg.data.cache_dir) / "tokenizers").glob("gguf-*"))
    damaged = entry / "tokenizer.json"
    damaged.write_text("{not json", encoding="utf-8")
    meta = json.loads((entry / COMPLETE_MARKER).read_text())
    meta[FILES_KEY]["tokenizer.json"] = [damaged.stat().st_size, file_sha256(damaged)]
    (entry / COMPLETE_MARKER).write_text(json.dumps(meta), encoding="utf-8")
    assert gguf_tokenizer(cfg)("def f3(x):")["input_ids"] == expected
    assert "cannot be read" in capsys.readouterr().err
    assert json.loads(damaged.read_text())  # rebuilt
