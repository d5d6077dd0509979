"""`model.gguf_file` checked before anything loads: the file is there, it is a whole GGUF file whose every tensor
transformers can dequantise, and transformers can load its architecture. The file is read here as transformers will
read it (the gguf package's `GGUFReader`, which maps it, and its `dequantize` on each tensor type), so a truncated
download or a damaged header is refused naming the file, not found out by a traceback at load time. No torch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llmexp.errors import UserError
from llmexp.rundir.readers import Damaged, open_regular, reader

MAGIC = b"GGUF"
NOT_CAUSAL_LM = ("general", "tokenizer", "t5", "umt5")
"""Keys of transformers' GGUF config table that are not architectures a causal LM loads from (t5: seq2seq)."""


@reader
def read_architecture(path: Path) -> str:
    """`general.architecture` of a GGUF file, read whole: its header, and every tensor's type (one gguf can
    dequantise) and extent (inside the file)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGUFReader, dequantize

    with open_regular(path) as f:  # (np.memmap would wait on a FIFO)
        if (magic := f.read(4)) != MAGIC:
            raise Damaged(path, f"it is not a GGUF file (it starts with {magic!r}, not {MAGIC!r})")
    try:
        gguf = GGUFReader(path)
        field = gguf.fields.get("general.architecture")
        arch = field.contents() if field is not None else None
    except RecursionError:
        raise Damaged(path, "its header is damaged (metadata nested too deeply to read)") from None
    except Exception as err:  # ValueError, KeyError, ...: whatever the bytes made the reader do
        raise Damaged(path, f"it is damaged or cut short ({type(err).__name__}: {str(err)[:200]})") from None
    if not isinstance(arch, str):
        raise Damaged(path, "its metadata has no general.architecture")
    for kind in {t.tensor_type for t in gguf.tensors}:
        try:
            dequantize(np.zeros((1, GGML_QUANT_SIZES[kind][1]), np.uint8), kind)
        except NotImplementedError:
            raise Damaged(path, f"its tensors of type {kind.name} cannot be dequantised by gguf (re-quantise the "
                          "model, e.g. to Q8_0 or Q4_K_M, with llama.cpp)") from None
    return arch


def loadable_architectures() -> list[str]:
    """The GGUF architectures this transformers loads as a causal LM (its GGUF config table; no torch import)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return sorted(a for a in GGUF_CONFIG_MAPPING if a not in NOT_CAUSAL_LM)


def gguf_file_problem(path: Path) -> str | None:
    key = "model.gguf_file"
    fix = "point it at a .gguf file from llama.cpp (or drop it to load the directory's safetensors)"
    if not path.is_file():
        return f"{key}: no such file {path}; {fix}"
    if path.stat().st_size == 0:
        return f"{key}: {path} is empty; {fix}"
    if importlib.util.find_spec("gguf") is None:
        return f"{key} needs the gguf package: pip install 'llmexp[gguf]' (or pip install gguf)"
    try:
        arch = read_architecture(path)
    except UserError as err:
        return f"{key}: {err}"
    import transformers

    known = loadable_architectures()
    names = {arch, arch.replace("-", "_"), arch.replace("moe", "_moe")}  # qwen2moe -> qwen2_moe, gpt-oss -> gpt_oss
    if not names & set(known):
        return (f"{key}: {path.name} holds a {arch!r} model, an architecture transformers {transformers.__version__} "
                f"cannot load from GGUF; it loads {', '.join(known)}")
    return None


def local_gguf(name_or_path: str, gguf_file: str) -> Path | None:
    """The GGUF file's path when `name_or_path` is a local directory; None for a hub id (fetched later)."""
    directory = Path(name_or_path).expanduser()
    return directory / gguf_file if directory.is_dir() else None
