#!/usr/bin/env bash
# FSDP2 full_shard on a ~1B-parameter model, prepared to run once on a GPU machine (minutes, no network):
#   bash benchmarks/gpu_fsdp.sh [OUT_DIR]              # OUT_DIR: default $OUT, else benchmarks/results
#   bash benchmarks/gpu_fsdp.sh --tiny --cpu DIR       # the same path on a CPU, tiny model, 3 steps (the test)
# The model: a random-init Llama built from the config (hidden 2048, 16 layers, MLP 8192, 16 heads,
# vocabulary 8192: ~1.1B parameters), trained on the stdlib corpus with fsdp=full_shard precision=bf16,
# micro-batch 8 x 1024 tokens, 40 steps, on every visible GPU (torchrun, one process per GPU; one GPU runs
# FSDP over a one-process group). Writes OUT_DIR/fsdp_gpu.md with the card, tokens/s, MFU (against the
# measured bf16 matmul ceiling) and peak memory (torch.cuda.max_memory_allocated, busiest rank) from the
# run's summary.json, and keeps the run directory next to it. Not yet run on a GPU.
set -euo pipefail
model=(model.hidden_size=2048 model.num_hidden_layers=16 model.num_attention_heads=16 model.num_key_value_heads=16
       model.intermediate_size=8192 model.vocab_size=8192 model.max_position_embeddings=1024 data.max_length=1024)
run=(batch_size=8 train.max_steps=40 train.logging_steps=5 train.eval_steps=1000 train.save_steps=0
     train.eval_batches=2 precision=bf16 lr=3e-4)
processes=0
cpu=0
out="${OUT:-}"
while [ $# -gt 0 ]; do
    case "$1" in
        --tiny) model=(model.hidden_size=64 model.num_hidden_layers=2 model.num_attention_heads=2
                       model.num_key_value_heads=2 model.intermediate_size=128 model.vocab_size=512
                       model.max_position_embeddings=64 data.max_length=64 data.max_examples=60)
                run=(batch_size=4 train.max_steps=3 train.logging_steps=1 train.eval_steps=1000 train.save_steps=0
                     train.eval_batches=1 precision=fp32 lr=1e-3 train.peak_tflops=1) ;;  # the path, not the figures
        --cpu) cpu=1; processes=1 ;;
        *) out="$1" ;;
    esac
    shift
done
cd "$(dirname "$0")/.."
out="$(realpath -m "${out:-benchmarks/results}")"
mkdir -p "$out"
card="cpu (--cpu)"
if [ "$cpu" -eq 0 ]; then
    python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: run this on a GPU machine, or pass --tiny --cpu')"
    processes="$(python -c 'import torch; print(torch.cuda.device_count())')"
    card="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1 || true)"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LLMEXP_NO_BAR=1
run_dir="$out/fsdp_gpu_run"
rm -rf "$run_dir"
python -m torch.distributed.run --standalone --nproc_per_node="$processes" -m llmexp fsdp=full_shard \
    "${model[@]}" "${run[@]}" train.resume=never "hydra.run.dir=$run_dir"
python - "$run_dir/summary.json" "$out/fsdp_gpu.md" "$card" "$processes" <<'PY'
import json, sys, time
summary, out, card, processes = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3], sys.argv[4]
mfu = summary["mfu"]
rows = [("card", card), ("date", time.strftime("%Y-%m-%d")), ("processes", processes),
        ("parameters", f"{summary['total_params'] / 1e9:.2f}B"), ("fsdp", summary["fsdp"]),
        ("precision", summary["precision"]), ("global batch", summary["global_batch_size"]),
        ("tokens/s", f"{summary['tokens_per_sec']:,.0f}"), ("MFU", f"{mfu:.1%}" if mfu is not None else "n/a"),
        ("peak memory", f"{summary['peak_mem_mb'] / 1024:.1f} GiB")]
text = "# FSDP2 full_shard (benchmarks/gpu_fsdp.sh)\n\n| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
open(out, "w").write(text)
print(text)
PY
