"""A GGUF file as a model source, the weights: transformers' GGUF support dequantises them (`from_pretrained(...,
gguf_file=...)`, the `gguf` package) into plain `nn.Linear`s of the run's dtype, once per machine, and the result is
saved as an ordinary safetensors directory (`data.cache_dir/models/gguf-<key>/`, the key a hash of the file's bytes,
the dtype and the library versions). Runs load that directory like any local model, so `model/`, checkpoints,
merging and resuming see nothing special. `convert` is also what `benchmarks/pretrained.py` uses.
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmexp.data.cache import get_or_build
from llmexp.data.gguf import gguf_key, gguf_path
from llmexp.model.save import save_model_dir

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig


def convert(gguf_file: Path, out: Path, dtype: torch.dtype) -> dict[str, Any]:
    """Dequantise `gguf_file` to `dtype` and save it (safetensors, config, tokenizer) in `out`; returns its facts."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers' "Converting and de-quantizing GGUF tensors..." bar is plain tqdm on stderr, which neither its
    # disable_progress_bar() nor a logging filter reaches: the console is ours, the bar goes to the job log.
    with contextlib.redirect_stderr(io.StringIO()) as bar:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=dtype)
    if last := bar.getvalue().strip().rsplit("\r", 1)[-1]:
        logging.getLogger("transformers.modeling_gguf_pytorch_utils").info("%s", last)  # third-party: the log only
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    # transformers 5 keeps its GGUF quantizer on a model whose every weight it dequantised into a plain nn.Linear, and
    # then refuses to save it ("quantized with gguf and is not serializable") or to train it (`is_trainable` is
    # False). The weights are dense here, so the quantizer and its config entry are dropped.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    save_model_dir(model, out)
    tokenizer.save_pretrained(out)
    config = model.config
    return {"gguf_file": str(gguf_file), "dtype": str(dtype).removeprefix("torch."), "model_type": config.model_type,
            "architecture": type(model).__name__, "num_params": sum(p.numel() for p in model.parameters()),
            "vocab_size": config.vocab_size, "tokenizer_len": len(tokenizer),
            "context_length": config.max_position_embeddings, "tie_word_embeddings": bool(config.tie_word_embeddings),
            "hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
            "transformers": transformers.__version__}


def gguf_model_dir(cfg: DictConfig, dtype: torch.dtype) -> Path:
    """The cached dequantised conversion of `model.gguf_file` in `dtype`, made now on the first call on this machine
    (a file lock makes concurrent sweep jobs convert it once)."""
    path = gguf_path(cfg)
    key = "gguf-" + gguf_key(path, dtype=str(dtype))
    return get_or_build(Path(str(cfg.data.cache_dir)), "models", key, lambda tmp: convert(path, tmp, dtype))[0]
