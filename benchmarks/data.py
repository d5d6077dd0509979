"""Data-path benchmarks; every figure is a ratio against a baseline measured in the same run.

1. Tokenise-and-pack throughput (tokens/s) of llmexp's pipeline against the usual `datasets.map`
   pipeline (tokenise with the same tokenizer, then `group_texts` into blocks, as in HF's run_clm.py).
2. The cold `build_datasets` (tokenise, pack, write the cache) against a cache hit.
3. Training-step time with real batches (sampler + memmap + `get_batch`) against synthetic tokens
   already in memory, on the tiny model. Target: <= 1.02x, i.e. the data path is never the bottleneck.

Item 1 runs in memory on the stdlib; `benchmarks/data_hf.py` measures `data=hf` end to end (parquet
files in, the token cache out) against the same recipe on >= 100 MB, each side in a fresh process.

    python benchmarks/data.py                 # the whole stdlib, 30 steps per arm, alternating
    python benchmarks/data.py --files 100 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from llmexp.config.schema import compose_config


def bench_tokenise(texts: list[str], tok: Any, block: int, num_proc: int) -> None:
    import datasets

    from llmexp.data.datasets import cut_examples
    from llmexp.data.encode import encode_lm

    start = time.perf_counter()
    arrays, stats = cut_examples("lm_packed", encode_lm(texts, tok), None, block, keep_tail=False)
    ours_s = time.perf_counter() - start
    n_tokens = stats["tokens"] + stats["dropped_tokens"]

    datasets.disable_caching()
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()

    def group_texts(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        flat = [t for ids in batch["input_ids"] for t in ids]
        full = len(flat) // block * block
        return {"input_ids": [flat[i:i + block] for i in range(0, full, block)]}

    start = time.perf_counter()
    ds = datasets.Dataset.from_dict({"text": texts})
    eos = tok.eos_token_id
    ds = ds.map(lambda b: {"input_ids": [[*ids, eos] for ids in tok(b["text"])["input_ids"]]}, batched=True,
                remove_columns=["text"], num_proc=num_proc if num_proc > 1 else None)
    ds = ds.map(group_texts, batched=True, batch_size=1000, num_proc=num_proc if num_proc > 1 else None)
    ds.with_format("numpy")["input_ids"]  # materialise, as a trainer would
    hf_s = time.perf_counter() - start
    print(f"tokenise+pack   llmexp {n_tokens / ours_s:12,.0f} tok/s ({ours_s:.2f} s) | datasets.map "
          f"(num_proc={num_proc}) {n_tokens / hf_s:12,.0f} tok/s ({hf_s:.2f} s) | speed-up {hf_s / ours_s:.2f}x "
          f"| {len(ds)} vs {len(arrays['offsets']) - 1} blocks")


def bench_cache(cfg: Any, tok: Any) -> None:
    from llmexp.data.datasets import build_datasets

    start = time.perf_counter()
    build_datasets(cfg, tok)
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    _, _, stats = build_datasets(cfg, tok)
    hit_s = time.perf_counter() - start
    assert stats["data_cache_hit"]
    print(f"build_datasets  cold {cold_s:.2f} s | cache hit {hit_s * 1000:.0f} ms | {cold_s / hit_s:,.0f}x")


def bench_train_step(cfg: Any, tok: Any, steps: int, rounds: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmexp.data.datasets import batch_indices, build_datasets

    train, _, _ = build_datasets(cfg, tok)
    m, batch_size, block = cfg.model, int(cfg.batch_size), int(cfg.data.max_length)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads, max_position_embeddings=m.max_position_embeddings,
        attn_implementation="sdpa"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    synthetic = torch.randint(0, len(tok), (batch_size, block))

    def step(batch: dict[str, torch.Tensor]) -> None:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed(real: bool, s: int) -> float:
        start = time.perf_counter()
        if real:
            batch = train.get_batch(batch_indices(0, s, batch_size, len(train)))
        else:
            batch = {"input_ids": synthetic, "labels": synthetic}
        step(batch)
        return time.perf_counter() - start

    timed(True, 0)  # warm-up: allocator, kernels, page cache
    real_s, synth_s = [], []
    for s in range(1, steps * rounds + 1):  # alternate step by step, so load swings hit both arms alike
        first_real = s % 2 == 0
        (real_s if first_real else synth_s).append(timed(first_real, s))
        (synth_s if first_real else real_s).append(timed(not first_real, s))
    fetch = time.perf_counter()
    for s in range(100):
        train.get_batch(batch_indices(0, s, batch_size, len(train)))
    fetch_ms = (time.perf_counter() - fetch) * 10
    real, synth = statistics.median(real_s), statistics.median(synth_s)
    print(f"train step      real data {real * 1000:.1f} ms | synthetic {synth * 1000:.1f} ms | "
          f"ratio {real / synth:.3f}x (target <= 1.02x) | sampler+get_batch alone {fetch_ms:.2f} ms/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=None, help="stdlib train files to use (default: all)")
    parser.add_argument("--steps", type=int, default=30, help="train steps per arm (times --rounds)")
    parser.add_argument("--rounds", type=int, default=1, help="multiplies --steps")
    parser.add_argument("--num-proc", type=int, default=2, help="datasets.map processes")
    args = parser.parse_args()

    from llmexp.data.corpora import read_text, split_by_hash, stdlib_files, stdlib_root
    from llmexp.data.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as cache:
        extra = [f"data.max_examples={args.files}"] if args.files else []
        cfg = compose_config([f"data.cache_dir={cache}", *extra])
        tok = load_tokenizer(cfg)
        train_files = split_by_hash(stdlib_files(), float(cfg.data.eval_fraction))[0][: args.files]
        texts = [read_text(Path(stdlib_root()) / f) for f in train_files]
        print(f"{len(texts)} stdlib files, {sum(map(len, texts)) / 1e6:.1f} M chars, vocab {len(tok)}, "
              f"block {cfg.data.max_length}")
        bench_tokenise(texts, tok, int(cfg.data.max_length), args.num_proc)
        bench_cache(cfg, tok)
        bench_train_step(cfg, tok, args.steps, args.rounds)


if __name__ == "__main__":
    main()
