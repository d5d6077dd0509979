"""`data=hf` tokenise-and-pack throughput against HF's standard recipe, on >= 100 MB of parquet (issue 16).

The corpus: the .py files of this interpreter's standard library (what `data=stdlib` reads), one
file per row of a `text` column, copied until it reaches --mb; copy k > 0 of a file starts with a
`# copy k of <path>` line, so no two rows are equal. Written as parquet shards in a temp dir.

The tokenizer: llmexp's own byte-level BPE recipe (`train_bpe`, vocab 8192), trained once beforehand
on the first ~4 MB of the corpus and saved to a directory both arms load: the same token ids.

Two arms, each in a fresh process with an empty HF datasets cache, alternating which goes first:
- llmexp: `build_datasets` on `data=hf data.path=parquet data.data_files=... data.packing=true` with
  an empty token cache (cold), then again (warm: a cache hit). `data.eval_split='train[:1]'` makes
  the eval split one row, so the train split is the whole corpus in file order, as HF's is.
- datasets.map: transformers' run_clm.py recipe: `load_dataset("parquet")`, `.map(tokenize,
  batched=True, num_proc=N, remove_columns)`, `.map(group_texts, batched=True, num_proc=N)` (input_ids,
  attention_mask and labels, caching on, as run_clm leaves it), then the same again (warm: every map
  loads its cache file). One change: tokenize appends eos to every document as llmexp does (run_clm
  adds none), so both sides produce the same token stream.
Both cap the tokenizers thread pool at N threads (RAYON_NUM_THREADS=N); llmexp is one process.

Checks: llmexp's packed train tokens are exactly the first tokens of HF's tokenised stream; the
block counts differ only by tails (run_clm's group_texts drops a tail per batch of 1000 rows).

    python benchmarks/data_hf.py                # >= 100 MB, 2 rounds, writes benchmarks/results/data_hf.md
    python benchmarks/data_hf.py --quick        # a few MB, 1 round, prints the facts as JSON, writes nothing
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, load_average, machine, markdown_table, publish, rotated, run_process, utc_now

ARMS = ["llmexp", "hf"]
SHARD_BYTES = 32 * 10**6
"""Rows per parquet file: about this many bytes of text, so large corpora come as several files."""


# ---------------------------------------------------------------- corpus and tokenizer


def stdlib_documents() -> list[tuple[str, str]]:
    """(relative path, text) of every stdlib file `data=stdlib` reads, tests excluded."""
    from llmexp.data.corpora import read_text, stdlib_files, stdlib_root

    root = Path(stdlib_root())
    return [(f, read_text(root / f)) for f in stdlib_files()]


def write_corpus(out: Path, min_mb: float) -> tuple[list[Path], int, int]:
    """Parquet shards of at least `min_mb` MB of text: (files, UTF-8 bytes, rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = stdlib_documents()
    files: list[Path] = []
    shard: list[str] = []
    shard_bytes = total = rows = copy = 0
    while total < min_mb * 1e6:
        for path, text in docs:
            row = text if copy == 0 else f"# copy {copy} of {path}\n{text}"
            size = len(row.encode())
            shard.append(row)
            shard_bytes, total, rows = shard_bytes + size, total + size, rows + 1
            if shard_bytes >= SHARD_BYTES or total >= min_mb * 1e6:
                files.append(out / f"part-{len(files):03d}.parquet")
                pq.write_table(pa.table({"text": shard}), files[-1])
                shard, shard_bytes = [], 0
            if total >= min_mb * 1e6:
                break
        copy += 1
    return files, total, rows


def save_tokenizer(files: list[Path], out: Path, sample_mb: float = 4.0) -> None:
    """llmexp's BPE recipe trained on the corpus's first `sample_mb` MB, saved for both arms."""
    import pyarrow.parquet as pq

    from llmexp.data.tokenizer import train_bpe

    texts, size = [], 0
    for text in pq.read_table(files[0], columns=["text"]).column("text").to_pylist():
        texts.append(text)
        size += len(text)
        if size >= sample_mb * 1e6:
            break
    train_bpe(texts, 8192).save_pretrained(str(out))


# ---------------------------------------------------------------- the arms (each in a fresh process)


def arm_llmexp(work: Path, files: list[Path], block: int) -> dict[str, Any]:
    import datasets  # noqa: F401  imported before the clock starts, as in the datasets.map arm

    from llmexp.config.schema import compose_config
    from llmexp.data.datasets import build_datasets
    from llmexp.data.tokenizer import load_tokenizer

    cfg = compose_config(["data=hf", "data.path=parquet", "data.data_files=[" + ",".join(f"'{f}'" for f in files) + "]",
                          "data.eval_split='train[:1]'", "data.packing=true", f"data.max_length={block}",
                          f"data.tokenizer={work / 'tokenizer'}", f"data.cache_dir={work / 'llmexp_cache'}"])
    tok = load_tokenizer(cfg)
    start = time.perf_counter()
    train, _, stats = build_datasets(cfg, tok)
    cold_s = time.perf_counter() - start
    assert not stats["data_cache_hit"], "the llmexp arm must start with an empty cache"
    start = time.perf_counter()
    _, _, warm = build_datasets(cfg, tok)
    warm_s = time.perf_counter() - start
    assert warm["data_cache_hit"]
    np.save(work / "llmexp_ids.npy", np.asarray(train.ids))  # for the parent's token check, after timing
    return {"seconds": cold_s, "warm_s": warm_s, "blocks": len(train),
            "tokens": stats["data_train_tokens"] + stats["data_train_dropped_tokens"]}


def arm_hf(work: Path, files: list[Path], block: int, num_proc: int) -> dict[str, Any]:
    import datasets
    import pyarrow.compute as pc
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(str(work / "tokenizer"))
    eos = tok.eos_token_id
    procs = num_proc if num_proc > 1 else None

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        out = tok(batch["text"])
        return {"input_ids": [[*ids, eos] for ids in out["input_ids"]],
                "attention_mask": [[*m, 1] for m in out["attention_mask"]]}

    def group_texts(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:  # run_clm.py's
        joined = {k: [t for row in batch[k] for t in row] for k in batch}
        total = len(joined["input_ids"]) // block * block
        result = {k: [t[i:i + block] for i in range(0, total, block)] for k, t in joined.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    def recipe() -> tuple[Any, Any]:
        raw = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train")
        tokenized = raw.map(tokenize, batched=True, num_proc=procs, remove_columns=raw.column_names)
        return tokenized, tokenized.map(group_texts, batched=True, num_proc=procs)

    start = time.perf_counter()
    tokenized, grouped = recipe()
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    again = recipe()[1]  # run_clm run again: every map loads its cache file
    warm_s = time.perf_counter() - start
    assert again.cache_files == grouped.cache_files, "the datasets.map arm's second run must hit its cache"
    ids = pc.list_flatten(tokenized.data.column("input_ids")).to_numpy()
    np.save(work / "hf_ids.npy", ids.astype(np.uint16))  # vocab 8192: uint16 holds every id
    return {"seconds": seconds, "warm_s": warm_s, "blocks": len(grouped), "tokens": len(ids),
            "batches": math.ceil(len(tokenized) / 1000)}


def run_arm(arm: str, work: Path, files: list[Path], block: int, num_proc: int) -> dict[str, Any]:
    """One arm in a fresh process with fresh caches; its JSON result."""
    for stale in ("llmexp_cache", "hf_cache"):
        shutil.rmtree(work / stale, ignore_errors=True)
    cmd = [PY, __file__, "--arm", arm, "--work", str(work), "--block", str(block), "--num-proc", str(num_proc),
           "--files", *map(str, files)]
    env = {"HF_DATASETS_CACHE": str(work / "hf_cache"), "HF_HUB_OFFLINE": "1",
           "RAYON_NUM_THREADS": str(num_proc), "TOKENIZERS_PARALLELISM": "true"}
    result = run_process(cmd, env=env, timeout_s=3600)
    if result.returncode != 0 or not result.data:
        raise SystemExit(f"arm {arm} failed (exit {result.returncode}):\n{result.tail}")
    return {**result.data, "peak_rss_mb": result.peak_rss_mb}  # wait4: the largest of the arm's processes


# ---------------------------------------------------------------- checks and the table


def check_tokens(work: Path, block: int, llm: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """Facts that must hold: the same token stream, the same token count, blocks equal up to tails."""
    ours, theirs = np.load(work / "llmexp_ids.npy"), np.load(work / "hf_ids.npy")
    return {"same_tokens": bool(len(ours) <= len(theirs) and np.array_equal(ours, theirs[: len(ours)])),
            "same_token_count": llm["tokens"] == hf["tokens"],
            "llmexp_tail_only": len(theirs) - len(ours) < block,
            "blocks_differ_by_tails_only": 0 <= llm["blocks"] - hf["blocks"] <= hf["batches"]}




def versions() -> str:
    import datasets
    import pyarrow
    import tokenizers
    import transformers

    return (f"Python {platform.python_version()}, datasets {datasets.__version__}, "
            f"tokenizers {tokenizers.__version__}, transformers {transformers.__version__}, "
            f"pyarrow {pyarrow.__version__}")


def table(rounds: list[dict[str, dict[str, Any]]], mb: float, rows: int, args: argparse.Namespace,
          load_at_start: str) -> str:
    def med(arm: str, key: str) -> float:
        return statistics.median(r[arm][key] for r in rounds)

    def paired(key: str, bold: bool) -> str:  # datasets.map's seconds over llmexp's, within each round
        ratios = [r["hf"][key] / r["llmexp"][key] for r in rounds]
        spread = f" ({min(ratios):,.2f}–{max(ratios):,.2f})" if len(ratios) > 1 else ""
        value = f"{statistics.median(ratios):,.2f}×"
        return (f"**{value}**" if bold else value) + spread

    tokens = rounds[0]["llmexp"]["tokens"]

    def row(name: str, arm: str, key: str, ratio: str, rss: str) -> list[str]:
        seconds = med(arm, key)
        return [name, f"{seconds:.2f}", f"{tokens / seconds:,.0f}", f"{mb / seconds:,.1f}",
                f"{rounds[0][arm]['blocks']:,}", ratio, rss]

    hf = f"`datasets.map` (run_clm.py recipe, num_proc={args.num_proc})"
    body = [row("llmexp `build_datasets`, cold (empty cache)", "llmexp", "seconds", paired("seconds", True),
                f"{med('llmexp', 'peak_rss_mb'):,.0f} MB"),
            row(f"{hf}, cold (empty cache)", "hf", "seconds", "1.00×", f"{med('hf', 'peak_rss_mb'):,.0f} MB"),
            row("llmexp `build_datasets`, warm (cache hit)", "llmexp", "warm_s", paired("warm_s", False), ""),
            row(f"{hf}, warm (its cache files)", "hf", "warm_s", "1.00×", "")]
    load_at_end = load_average()
    loaded = max(float(load_at_start.split()[0]), float(load_at_end.split()[0])) > (os.cpu_count() or 1)
    note = (" The machine was loaded (other jobs shared its cores): absolute figures are below an idle "
            "machine's; the paired speed-ups are the figures to compare." if loaded else "")
    header = (f"Measured {utc_now()} on {machine()}; {versions()}. Load average at the start "
              f"{load_at_start}, at the end {load_at_end}.{note}\n\n"
              f"Corpus: {mb:.1f} MB of text ({rows:,} parquet rows: the stdlib's .py files, copied until "
              f"{args.mb:g} MB), {tokens:,} tokens (byte-level BPE, vocab 8192, the same for both), blocks of "
              f"{args.block}; {len(rounds)} round(s), each arm in a fresh process with empty caches, alternating "
              "which goes first; medians. Warm: the same calls again in the same process. Peak RSS: the largest "
              "of the arm's processes (wait4).\n\n")
    return header + markdown_table(
        ["arm", "seconds", "tokens/s", "MB/s", "blocks", "speed-up over datasets.map (paired)", "peak RSS"], body)


def benchmark(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="llmexp-data-hf-") as tmp:
        work = Path(tmp)
        files, nbytes, rows = write_corpus(work, args.mb)
        save_tokenizer(files, work / "tokenizer")
        load_at_start = load_average()
        rounds: list[dict[str, dict[str, Any]]] = []
        facts: dict[str, Any] = {}
        for i in range(args.rounds):
            result = {arm: run_arm(arm, work, files, args.block, args.num_proc) for arm in rotated(ARMS, i)}
            if i == 0:  # the same corpus and tokenizer every round: checking once is enough
                facts = check_tokens(work, args.block, result["llmexp"], result["hf"])
            rounds.append(result)
            print(f"round {i + 1}: " + json.dumps(result), file=sys.stderr)
        text = table(rounds, nbytes / 1e6, rows, args, load_at_start)
    ratios = [r["hf"]["seconds"] / r["llmexp"]["seconds"] for r in rounds]
    return text, {**facts, "speedup": statistics.median(ratios), "mb": nbytes / 1e6, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few MB, one round, JSON facts, no result file")
    parser.add_argument("--mb", type=float, default=100.0, help="corpus size in MB of text (at least)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--block", type=int, default=1024, help="block size (run_clm's default)")
    parser.add_argument("--num-proc", type=int, default=os.cpu_count() or 1, help="processes / tokenizer threads")
    parser.add_argument("--out", default="data_hf.md", help="file under benchmarks/results ('' for none)")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # internal: run one arm
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--files", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        run = arm_llmexp(args.work, args.files, args.block) if args.arm == "llmexp" else \
            arm_hf(args.work, args.files, args.block, args.num_proc)
        print(json.dumps(run))
        return
    if args.quick:
        args.mb, args.rounds, args.out = min(args.mb, 3.0), 1, ""
    text, facts = benchmark(args)
    publish(text, args.out)
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
