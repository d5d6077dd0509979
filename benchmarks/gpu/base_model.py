"""A random-init Llama for step 3, saved where `model.name_or_path` can load it:

    python benchmarks/gpu/base_model.py DIR FIELDS_JSON --tokenizer TOKENIZER_DIR

FIELDS_JSON: LlamaConfig fields ({"hidden_size": 2048, ...}); the tokenizer is copied from TOKENIZER_DIR (a
run's model/ directory). A vocabulary larger than the tokenizer's is fine: its ids are all below it, and the
head still projects onto every row (the cost step 3 measures). Uses transformers only, not llmexp.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path)
    parser.add_argument("fields", type=json.loads)
    parser.add_argument("--tokenizer", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(attn_implementation="sdpa", **args.fields))  # as llmexp builds from config
    model.save_pretrained(args.dir)
    AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(args.dir)
    print(json.dumps({"dir": str(args.dir), "params": sum(p.numel() for p in model.parameters())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
