"""`llmexp.model.save.save_model_dir`: transformers' save_pretrained, the same files, without importing DeepSpeed
(and with it mlflow) in a process that never did: ~1.5 s of CPU at the end of every run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

SAVE_AND_LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM, LlamaConfig
from accelerate.utils import other
from llmexp.model.save import save_model_dir
check = other.is_deepspeed_available
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=32, tie_word_embeddings=True)
model = AutoModelForCausalLM.from_config(config)
save_model_dir(model, sys.argv[1])
assert other.is_deepspeed_available is check, "the check was not put back"
print("deepspeed imported:", "deepspeed" in sys.modules, "mlflow imported:", "mlflow" in sys.modules)
loaded = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = torch.arange(16).view(2, 8)
assert torch.equal(model(ids).logits, loaded(ids).logits)
"""


def test_a_model_directory_is_written_and_loads_without_importing_deepspeed(tmp_path: Path) -> None:
    out = tmp_path / "model"
    proc = subprocess.run([sys.executable, "-c", SAVE_AND_LOAD, str(out)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deepspeed imported: False mlflow imported: False" in proc.stdout
    assert {p.name for p in out.iterdir()} == {"config.json", "generation_config.json", "model.safetensors"}
