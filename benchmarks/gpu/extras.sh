#!/usr/bin/env bash
# Measurements for a lease's leftover device time (a machine starts only with 4 minutes left), after both parts
# of run.sh: what issue 41 still needs measured on a GPU before llmexp changes its path. ~2 minutes on an H200.
#   bash benchmarks/gpu/extras.sh OUT
# 1. benchmarks/attention_mask.py: packed SFT rows under SDPA's dense block-diagonal mask against FlexAttention's
#    block mask (`packed_flex`), beside the maskless and padding-mask arms (0.27B Llama, 8 x 2048, bf16).
# 2. benchmarks/loss_head.py: llmexp's fused head against Liger's fused linear cross-entropy (the carried
#    liger-kernel wheel) and the plain logits + cross-entropy, at a 32k and a 128k vocabulary.
set -uo pipefail
out="${1:?usage: extras.sh OUT}"
cd "$(dirname "$0")/../.."
mkdir -p "$out"
PY="${PYTHON:-python3}"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "extras: the wheels did not install (bash benchmarks/gpu/prepare.sh first)" >&2; exit 1; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
run() { local name="$1"; shift; echo "== $name: $*"; timeout 150 "$PY" "$@" 2>&1 | tee "$out/$name.md"; }
run attention_mask benchmarks/attention_mask.py --size mid --batch 8 --seq-len 2048 --warmup 3 --steps 8
run loss_head_32k benchmarks/loss_head.py --tokens 16384 --hidden 1024 --vocab 32000 --warmup 3 --steps 8
run loss_head_128k benchmarks/loss_head.py --tokens 16384 --hidden 4096 --vocab 128256 --warmup 3 --steps 8
