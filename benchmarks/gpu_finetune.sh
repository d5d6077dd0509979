#!/usr/bin/env bash
# LoRA and QLoRA on a lent GPU, prepared to run once (a few minutes, no network needed):
#   bash benchmarks/gpu_finetune.sh [OUT_DIR]           # OUT_DIR: default $OUT, else benchmarks/results
#   bash benchmarks/gpu_finetune.sh --tiny --cpu DIR    # the same path on a CPU, tiny model, 3 steps (the test)
# benchmarks/adapters.py --size 1b: a ~1.0B-parameter random-init Llama (hidden 2048, 16 layers, MLP 8192,
# vocabulary 8192) saved locally with llmexp's stdlib BPE tokenizer; `peft=lora` and `peft=qlora`, 50
# steps each (5 warm-up + 45 timed), micro-batch 8 x 1024, precision=bf16, each a fresh `python -m llmexp`.
# Writes OUT_DIR/peft_gpu.md: the card, the date, trainable parameters, optimizer state, peak memory
# (torch.cuda.max_memory_allocated) and tokens/s. ARMS=full,lora,qlora adds full fine-tuning (~16 GB of
# weights, gradients and AdamW state at 1B) for ratios. Needs a CUDA build of torch and bitsandbytes.
set -euo pipefail
size=1b
steps=(--warmup 5 --steps 45)
cpu=()
out="${OUT:-}"
while [ $# -gt 0 ]; do
    case "$1" in
        --tiny) size=tiny; steps=(--warmup 1 --steps 2) ;;  # the path, not the figures: seconds
        --cpu) cpu=(--cpu) ;;
        *) out="$1" ;;
    esac
    shift
done
cd "$(dirname "$0")/.."
out="$(realpath -m "${out:-benchmarks/results}")"
smi="not run (--cpu)"
if [ ${#cpu[@]} -eq 0 ]; then
    python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: run this on a GPU machine, or pass --tiny --cpu')"
    smi="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1 || true)"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python benchmarks/adapters.py --size "$size" "${cpu[@]}" --arms "${ARMS:-lora,qlora}" --precision bf16 \
    "${steps[@]}" --out peft_gpu.md --out-dir "$out"
printf '\nnvidia-smi (name, memory, driver): %s\n' "$smi" >> "$out/peft_gpu.md"
