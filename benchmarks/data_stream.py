"""`data.streaming=true` against the cached path: the cost per training step, measured in one run.

The same parquet file (stdlib files as a `text` column), the same tokenizer and the same tiny model; the
two arms alternate step by step, so load swings hit both alike. Per arm: the data alone (step_indices +
get_batch; for the stream this includes reading, permuting, tokenising and cutting each window when it
is reached, so its mean is the amortised cost) and the whole step (data + forward + backward + AdamW).

    python benchmarks/data_stream.py                       # 300 files, 60 steps per arm, windows of 20 rows
    python benchmarks/data_stream.py --files 100 --steps 20 --out ''
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import llama_config, load_average, markdown_table, publish, utc_now

from llmexp.config.schema import compose_config


def _write_corpus(root: Path, files: int) -> tuple[Path, Path, int]:
    """stdlib texts as parquet, and a BPE tokenizer directory trained on them; returns their paths and size."""
    import datasets

    from llmexp.data.corpora import read_text, stdlib_files, stdlib_root
    from llmexp.data.tokenizer import train_bpe

    texts = [read_text(Path(stdlib_root()) / f) for f in stdlib_files()[:files]]
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": texts}).to_parquet(str(root / "corpus.parquet"))
    train_bpe(texts, 8192).save_pretrained(str(root / "tok"))
    return root / "corpus.parquet", root / "tok", sum(map(len, texts))


def _timed_steps(arms: dict[str, Any], model: Any, steps: int, batch: int) -> dict[str, dict[str, list[float]]]:
    """Alternate the arms step by step; per arm the seconds of the data alone and of the whole step."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times: dict[str, dict[str, list[float]]] = {name: {"data": [], "step": []} for name in arms}
    for s in range(steps):
        for name in (list(arms) if s % 2 else list(arms)[::-1]):
            ds, start = arms[name], time.perf_counter()
            rows = ds.get_batch(ds.step_indices(0, s, batch))
            fetched = time.perf_counter()
            model(**rows).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times[name]["data"].append(fetched - start)
            times[name]["step"].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=300, help="stdlib files in the parquet file")
    parser.add_argument("--steps", type=int, default=60, help="train steps per arm")
    parser.add_argument("--window", type=int, default=20, help="data.shuffle_window (rows)")
    parser.add_argument("--out", default="data_stream.md", help="file under benchmarks/results ('' prints only)")
    args = parser.parse_args()

    import torch
    from transformers import LlamaForCausalLM

    from llmexp.data.datasets import build_datasets
    from llmexp.data.stream import build_stream_datasets
    from llmexp.data.tokenizer import load_tokenizer

    torch.set_num_threads(1)  # a shared 2-core machine: one thread keeps both arms' timings steady
    with tempfile.TemporaryDirectory() as tmp:
        parquet, tok_dir, chars = _write_corpus(Path(tmp), args.files)
        common = ["data=hf", "data.path=parquet", f"data.data_files={parquet}", f"data.tokenizer={tok_dir}",
                  "data.max_length=256", "batch_size=8", "train.max_steps=1000", f"data.cache_dir={tmp}/cache",
                  "data.packing=true", "data.stream_eval_rows=10"]
        cfg = compose_config(common)
        tok = load_tokenizer(cfg)
        start = time.perf_counter()
        cached = build_datasets(cfg, tok)[0]
        build_s = time.perf_counter() - start
        stream_cfg = compose_config([*common, "data.streaming=true", f"data.shuffle_window={args.window}"])
        stream = build_stream_datasets(stream_cfg, tok)[0]
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(vocab_size=len(tok)))
        batch = int(cfg.batch_size)
        times = _timed_steps({"cached": cached, "streaming": stream}, model, args.steps, batch)
        cut = stream.position(args.steps + 10**9, batch)["examples"]  # examples cut so far (read ahead included)
        amortised = sum(times["streaming"]["data"]) / cut * batch
    publish(_table(times, args, chars, build_s, len(cached), batch) + f"\nThe stream's data cost per step over every "
            f"example it cut ({cut}, read-ahead included): **{amortised * 1000:.2f} ms**, i.e. "
            f"{amortised / statistics.mean(times['cached']['step']):.1%} of a cached step.\n", args.out)


def _table(times: dict[str, dict[str, list[float]]], args: Any, chars: int, build_s: float, blocks: int,
           batch: int) -> str:
    def ms(xs: list[float], how: Any) -> str:
        return f"{how(xs) * 1000:.2f}"

    rows = [[name, ms(t["data"], statistics.mean), ms(t["data"], statistics.median), ms(t["data"], max),
             ms(t["step"], statistics.mean), ms(t["step"], statistics.median)] for name, t in times.items()]
    c, s = times["cached"], times["streaming"]
    ratio = statistics.mean(s["step"]) / statistics.mean(c["step"])
    ratio_median = statistics.median(s["step"]) / statistics.median(c["step"])
    return (f"Measured {utc_now()}; load average at the end: {load_average()}.\n\n"
            f"`python benchmarks/data_stream.py --files {args.files} --steps {args.steps} --window {args.window}`: "
            f"{args.files} stdlib files ({chars / 1e6:.1f} M chars) in one parquet file, tiny model, "
            f"{batch} x 256-token packed blocks per step, one torch thread; the arms alternate step by step. "
            f"The cached arm's one-off build (tokenise all, write the cache) took {build_s:.2f} s for {blocks} "
            "blocks and is not in its per-step figures; the stream pays its tokenising as it goes "
            "(each window when it is reached: see the max).\n\n"
            + markdown_table(["arm", "data ms/step (mean)", "data median", "data max", "step ms (mean)",
                              "step median"], rows)
            + f"\n\nStreaming / cached, whole step: **{ratio:.3f}x** (mean, amortised), "
            f"{ratio_median:.3f}x (median).\n")


if __name__ == "__main__":
    main()
