#!/usr/bin/env bash
# Run on a CPU machine with network, before a GPU machine is lent (a minute):
#   bash benchmarks/gpu/prepare.sh            # writes .whl/ at the repo root (git ignores it)
# Downloads the wheels the GPU machine (Python 3.12, torch 2.11+cu130, no network) lacks and the kit's
# steps import, one version each, with no dependencies resolved (--no-deps: every need is named here),
# keeps only bitsandbytes' CUDA 13.0 library, and fails if the folder exceeds 40 MiB: it travels with the
# tree (64 MiB in all). benchmarks/gpu/run.sh installs them there with no network.
#
# What the kit's steps import that the GPU machine lacks (traced 2026-12-01: the top-level modules of every
# process of `run.sh --cpu --tiny`, mapped to distributions, minus /work/.library/device/KINDS.md's list):
#   hydra-core, omegaconf, antlr4-python3-runtime   every `python -m llmexp...` (Hydra composes the config)
#   bitsandbytes                                   optimizer=adamw8bit (step 1), peft=qlora (steps 4, 6)
#   liger-kernel                                   benchmarks/loss_head.py only (not a step), 0.9 MiB
# Not carried, because no step imports them: optuna (only sweep=tpe/random and pruning import it; Hydra's
# discovery of llmexp's sweeper plugin does not), datasets (only data=hf), submitit (only cluster=slurm),
# deepspeed and wandb; the whole tiny path passed with those and their needs (alembic, sqlalchemy, colorlog,
# mako, dill, multiprocess) made uninstalled. The trace also named boto3, httpx2, trio, pydantic and a few
# more: optional imports of this machine's newer huggingface_hub and accelerate, not of llmexp; the GPU
# machine's own versions (transformers 5.17, huggingface_hub 1.33) bring what they need. The carried wheels'
# own needs (pyyaml, packaging, numpy, torch) are on the GPU machine.
# Versions: those installed on the CPU machine where CI runs (pip list, 2026-12-01); all are py3-none
# wheels, so they fit Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.whl
limit_mib=40
wheels=(hydra-core==1.3.8 omegaconf==2.3.1 bitsandbytes==0.50.2)
sdist_only=(antlr4-python3-runtime==4.9.3)  # Hydra 1.3 pins antlr 4.9.*, published as an sdist only (pure Python)
# Not imported by llmexp: benchmarks/loss_head.py's `liger` arm (issue 41: Liger's fused linear cross-entropy
# where it measures faster than llmexp's head); its needs, torch and triton, are on the GPU machine.
benchmark_only=(liger-kernel==0.8.5)
platforms=(manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64
           manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

for spec in "${wheels[@]}" "${sdist_only[@]}"; do  # a pin that drifts from CI's install is worth knowing
    installed="$(python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "${spec%%==*}" \
                 2>/dev/null || echo none)"
    [ "$installed" = "${spec##*==}" ] || echo "prepare: warning: ${spec%%==*} is $installed here, ${spec##*==} is carried" >&2
done

rm -rf "$dest"
mkdir -p "$dest"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]/#/--platform=}" -d "$dest" "${wheels[@]}" "${benchmark_only[@]}"
# Built here from the sdist: pure Python, so the wheel is py3-none-any and installs on 3.12 as on 3.11.
python3 -m pip wheel --quiet --no-deps --no-binary=:all: -w "$dest" "${sdist_only[@]}"
for whl in "$dest"/*.whl; do
    case "$(basename "$whl")" in *-py3-none-*|*-py2.py3-none-*) ;;
        *) echo "prepare: error: $(basename "$whl") is not a pure-Python or py3-none wheel" >&2; exit 1 ;; esac
done
python3 benchmarks/gpu/wheels.py trim "$dest"/bitsandbytes-*.whl --keep cuda130
python3 benchmarks/gpu/wheels.py check "$dest" --limit-mib "$limit_mib"
