"""`model.gguf_file` checked before anything loads: the file is there, it is a GGUF file, and transformers can load
its architecture. The header is read here in plain Python (magic, version, then the metadata up to
`general.architecture`, which llama.cpp writes first), so the check costs no torch import and no pass over the file.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
NOT_CAUSAL_LM = ("general", "tokenizer", "t5", "umt5")
"""Keys of transformers' GGUF config table that are not architectures a causal LM loads from (t5: seq2seq)."""
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
MAX_KEYS = 4096
"""Metadata entries read before giving up on finding the architecture (llama.cpp writes it first)."""


class GgufHeaderError(ValueError):
    """The file is not a GGUF file this reader understands; the message says what was found."""


def read_architecture(path: Path) -> str:
    """`general.architecture` of a GGUF file (raises GgufHeaderError, OSError)."""
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != MAGIC:
            raise GgufHeaderError(f"it starts with {magic!r}, not {MAGIC!r}" if magic else "it is empty")
        order = "<" if struct.unpack("<I", _read(f, 4))[0] < 1 << 16 else ">"  # a big-endian file's version
        f.seek(4)
        version = struct.unpack(order + "I", _read(f, 4))[0]
        width = "I" if version == 1 else "Q"  # GGUF v1 counted in 32 bits
        _tensors, keys = struct.unpack(order + width * 2, _read(f, struct.calcsize(width) * 2))
        for _ in range(min(keys, MAX_KEYS)):
            key = _string(f, order, width)
            kind = struct.unpack(order + "I", _read(f, 4))[0]
            if key == "general.architecture" and kind == _STRING:
                return _string(f, order, width)
            _skip(f, order, width, kind)
    raise GgufHeaderError("its metadata has no general.architecture")


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GgufHeaderError("its header ends early (a truncated file?)")
    return data


def _string(f: BinaryIO, order: str, width: str) -> str:
    (length,) = struct.unpack(order + width, _read(f, struct.calcsize(width)))
    if length > 1 << 20:
        raise GgufHeaderError(f"a metadata string claims {length:,} bytes")
    return _read(f, length).decode("utf-8", errors="replace")


def _skip(f: BinaryIO, order: str, width: str, kind: int) -> None:
    if kind in _SCALARS:
        _read(f, struct.calcsize(_SCALARS[kind]))
    elif kind == _STRING:
        _string(f, order, width)
    elif kind == _ARRAY:
        item = struct.unpack(order + "I", _read(f, 4))[0]
        (count,) = struct.unpack(order + width, _read(f, struct.calcsize(width)))
        if item in _SCALARS:
            f.seek(count * struct.calcsize(_SCALARS[item]), 1)
        else:
            for _ in range(count):
                _skip(f, order, width, item)
    else:
        raise GgufHeaderError(f"unknown metadata value type {kind}")


def loadable_architectures() -> list[str]:
    """The GGUF architectures this transformers loads as a causal LM (its GGUF config table; no torch import)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return sorted(a for a in GGUF_CONFIG_MAPPING if a not in NOT_CAUSAL_LM)


def _transformers_names(arch: str) -> set[str]:
    """The names transformers may map a llama.cpp architecture to (qwen2moe -> qwen2_moe, gpt-oss -> gpt_oss)."""
    return {arch, arch.replace("-", "_"), arch.replace("moe", "_moe")}


def gguf_file_problem(path: Path, key: str = "model.gguf_file") -> str | None:
    """Why `path` cannot be loaded as a GGUF model here (None: it can), naming `key`."""
    import importlib.util

    fix = "point it at a .gguf file from llama.cpp (or drop it to load the directory's safetensors)"
    if not path.is_file():
        return f"{key}: no such file {path}; {fix}"
    if path.stat().st_size == 0:
        return f"{key}: {path} is empty; {fix}"
    try:
        arch = read_architecture(path)
    except GgufHeaderError as err:
        return f"{key}: {path} is not a GGUF file ({err}); {fix}"
    except OSError as err:
        return f"{key}: cannot read {path} ({err.strerror}); {fix}"
    if importlib.util.find_spec("gguf") is None:
        return f"{key} needs the gguf package: pip install 'llmexp[gguf]' (or pip install gguf)"
    import transformers

    known = loadable_architectures()
    if not _transformers_names(arch) & set(known):
        return (f"{key}: {path.name} holds a {arch!r} model, an architecture transformers {transformers.__version__} "
                f"cannot load from GGUF; it loads {', '.join(known)}")
    return None


def local_gguf(name_or_path: str, gguf_file: str) -> Path | None:
    """The GGUF file's path when `name_or_path` is a local directory; None for a hub id (fetched later)."""
    directory = Path(name_or_path).expanduser()
    return directory / gguf_file if directory.is_dir() else None
