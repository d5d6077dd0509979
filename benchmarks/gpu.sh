#!/usr/bin/env bash
# The GPU throughput check, prepared to run once on a lent GPU machine (a few minutes):
#   bash benchmarks/gpu.sh
# Every arm of benchmarks/throughput.py (hand-written loop, llmexp, HF Trainer, llmexp + compile) on a
# ~1B-parameter Llama in bf16, 2 rounds; writes benchmarks/results/throughput_gpu.md. Needs a CUDA
# build of torch (install without constraints-cpu.txt: pip install -e '.[test]').
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: run this on a GPU machine')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python benchmarks/throughput.py --model 1b --rounds 2 --warmup 5 --steps 20 --out throughput_gpu.md
