"""The tokenizer (`load_tokenizer`; which one: docs/how-to/data.md, "Tokenizer and cache"), always with an eos and a
pad token. `hub_error(name)` is the one message for a model or tokenizer the hub cannot serve here
(`llmexp.model.build` uses it too). transformers is imported inside functions only.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from llmexp.data.cache import cached, hash_obj
from llmexp.data.hub import hub_reachable
from llmexp.data.sources import load_corpus
from llmexp.errors import UserError, first_line

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EOS, PAD = "<|endoftext|>", "<|pad|>"
BPE_VERSION = 1
"""Bump when the BPE recipe changes, so cached tokenizers are rebuilt."""


def is_local_name(name: str) -> bool:
    """Whether a model or tokenizer name means a directory here (a path, or one that exists), not a hub id."""
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists()


def hub_error(name: str, cause: BaseException | None = None, key: str = "model.name_or_path") -> UserError:
    """A UserError for a model/tokenizer name that is neither a loadable local directory nor reachable
    on the hub: it names the model and says how to use a local path."""
    reason = f" ({type(cause).__name__}: {first_line(cause)})" if cause else ""
    if is_local_name(name):
        where = "is not a directory" if not Path(name).expanduser().exists() else "holds no loadable model/tokenizer"
        return UserError(f"{key}={name} {where}{reason}. Point it at a directory written by "
                         "save_pretrained, e.g. the model/ of an earlier run: "
                         f"{key}=outputs/<date>/<time>/model")
    short = name.rstrip("/").split("/")[-1]
    return UserError(
        f"cannot load {name!r}: it is not a local directory, and the Hugging Face hub is unreachable from here "
        f"or has no such repo{reason}. Use a local copy: where the hub is reachable run `huggingface-cli download "
        f"{name} --local-dir {short}`, copy that directory here and set {key}=/path/to/{short} "
        "(or point it at the model/ directory of an earlier llmexp run)."
    )


def hub_load_kwargs(name: str, key: str = "model.name_or_path") -> dict[str, Any]:
    """Extra `from_pretrained` kwargs for `name`: a local path as it is; a hub id offline reads only the
    local HF cache (`local_files_only`), which raises at once when the model is not there.
    Raises `hub_error` for a local-looking path that does not exist."""
    if Path(name).expanduser().exists():
        return {}
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise hub_error(name, key=key)
    return {} if hub_reachable() else {"local_files_only": True}


def _from_pretrained(name: str, key: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    kwargs = hub_load_kwargs(name, key)
    try:
        tok = AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError, ImportError) as err:  # hub errors subclass OSError; bad dirs raise ValueError
        raise hub_error(name, err, key) from None
    return _ensure_special_tokens(tok, name)


def _ensure_special_tokens(tok: Any, name: str) -> Any:
    """Every tokenizer we hand out has eos (documents are joined with it) and pad (padding id)."""
    if tok.eos_token is None:
        raise UserError(f"the tokenizer of {name} has no eos token; set data.tokenizer to one that has, "
                        "or add eos_token to its tokenizer_config.json")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token  # padded positions get label -100 and attention 0, so any id works
    return tok


def train_bpe(texts: Any, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style pre-tokenisation, no unknown tokens) with eos and pad tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 258 + 2:
        raise UserError(f"model.vocab_size={vocab_size} is too small for a byte-level BPE; use >= 260")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD,
                                   model_max_length=1 << 30)


def tokenizer_fingerprint(tok: Any) -> str:
    """A hash of everything that decides token ids: vocab, merges, normaliser, special tokens, template."""
    known = getattr(tok, "llmexp_fingerprint", None)  # set on tokenizers we trained: their cache key
    vocab = known or tok.backend_tokenizer.to_str()
    parts = [vocab, str(tok.chat_template), str(tok.eos_token), str(tok.pad_token)]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:20]


def load_tokenizer(cfg: DictConfig) -> PreTrainedTokenizerFast:
    """The run's tokenizer (the page the module docstring names says which)."""
    if cfg.data.finetune_only and not cfg.model.name_or_path:
        via = f" (experiment={cfg.experiment})" if cfg.experiment else ""
        raise UserError(f"data={cfg.data.name}{via} fine-tunes an earlier model: set model.name_or_path to a "
                        "run's model/ directory, e.g. "
                        "model.name_or_path=outputs/<date>/<time>/model (run `python -m llmexp` first to make one)")
    if cfg.data.tokenizer:
        return _from_pretrained(str(cfg.data.tokenizer), "data.tokenizer")
    if cfg.model.name_or_path and cfg.model.gguf_file:
        from llmexp.data.gguf import gguf_tokenizer

        return _ensure_special_tokens(gguf_tokenizer(cfg), f"{cfg.model.name_or_path}/{cfg.model.gguf_file}")
    if cfg.model.name_or_path:
        m = cfg.model
        return _from_pretrained(str(m.name_or_path), "model.name_or_path", m.revision, bool(m.trust_remote_code))
    return trained_tokenizer(cfg)


def trained_tokenizer(cfg: DictConfig) -> PreTrainedTokenizerFast:
    """The byte-level BPE of this corpus's train split, from the cache or trained now."""
    from transformers import AutoTokenizer

    corpus = load_corpus(cfg.data)
    vocab_size = int(cfg.model.vocab_size)
    key = hash_obj({"bpe": BPE_VERSION, "vocab_size": vocab_size, "corpus": corpus.bpe_fingerprint})

    def build(tmp: Path) -> dict[str, Any]:
        tok = train_bpe(corpus.bpe_texts(), vocab_size)
        tok.save_pretrained(str(tmp))
        return {"vocab_size": len(tok), "corpus": corpus.name}

    def load(entry: Path, meta: dict[str, Any]) -> PreTrainedTokenizerFast:
        tok = AutoTokenizer.from_pretrained(str(entry))
        if len(tok) != meta["vocab_size"]:  # read, but not as it was written
            raise ValueError(f"{len(tok)} tokens, {meta['vocab_size']} were saved")
        return tok

    tok, _, _ = cached(Path(str(cfg.data.cache_dir)), "tokenizers", key, build, load)
    tok.llmexp_fingerprint = f"bpe-{key}"  # hashing the vocab again would cost more than the load
    return tok
