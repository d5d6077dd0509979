"""A GGUF file as a model source, the data side: where the file is (a local directory, or a hub repo through the
hub cache), what identifies it (a hash of its bytes), and its tokenizer, converted once by transformers' GGUF
support and cached like any tokenizer. The weights are `llmexp.model.gguf`'s.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmexp.data.cache import cached, hash_obj
from llmexp.data.hub import hub_reachable
from llmexp.errors import UserError, first_line
from llmexp.machine.gguf import gguf_file_problem, local_gguf
from llmexp.rundir.readers import file_sha256

if TYPE_CHECKING:
    from omegaconf import DictConfig

CONVERSION_VERSION = 1
"""Bump when the conversion recipe changes, so cached conversions are made again."""


def gguf_path(cfg: DictConfig) -> Path:
    """The local path of `model.gguf_file`, fetched into the hub cache first for a hub repo; checked (missing,
    empty, not GGUF, an architecture transformers cannot load: UserError naming the key)."""
    m = cfg.model
    path = local_gguf(str(m.name_or_path), str(m.gguf_file))
    if path is None:
        from huggingface_hub import hf_hub_download

        try:
            path = Path(hf_hub_download(str(m.name_or_path), str(m.gguf_file), revision=m.revision,
                                        local_files_only=not hub_reachable()))
        except Exception as err:  # huggingface_hub's errors (no repo, no file, offline) share no base class
            raise UserError(f"model.gguf_file={m.gguf_file}: cannot fetch it from the hub repo {m.name_or_path} "
                            f"({type(err).__name__}: {first_line(err)}); download it where the hub is reachable and "
                            "set model.name_or_path to the directory that holds it") from None
    if problem := gguf_file_problem(path):
        raise UserError(problem)
    return path


@functools.cache
def _file_hash(path: Path, size: int, mtime_ns: int) -> str:
    # size and mtime_ns are read only as the cache key: a GGUF file rewritten in place is hashed again
    return file_sha256(path)


def gguf_key(path: Path, **extra: Any) -> str:
    """The cache key of a conversion of `path`: its bytes (hashed once per process), the libraries that convert
    it, and `extra` (the dtype)."""
    from importlib.metadata import version

    stat = path.stat()
    return hash_obj({"gguf": _file_hash(path.resolve(), stat.st_size, stat.st_mtime_ns), "v": CONVERSION_VERSION,
                     "transformers": version("transformers"), "gguf_package": version("gguf"), **extra})


def gguf_tokenizer(cfg: DictConfig) -> Any:
    """The GGUF file's tokenizer, as transformers converts it (cached in `data.cache_dir/tokenizers/`)."""
    from transformers import AutoTokenizer

    path = gguf_path(cfg)

    def build(tmp: Path) -> dict[str, Any]:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tok.save_pretrained(str(tmp))
        return {"gguf_file": str(path), "vocab_size": len(tok)}

    return cached(Path(str(cfg.data.cache_dir)), "tokenizers", "gguf-" + gguf_key(path), build,
                  lambda entry, _meta: AutoTokenizer.from_pretrained(str(entry)))[0]
