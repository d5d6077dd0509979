"""What a config key may hold, and `key()`, which puts a key's default, rule and doc on its schema field
(`name: type = key(default, rule, "doc")`; `keys` reads them there). Each rule says what it refuses (`problem`: a
message naming the key, or None) and, in words, what it takes (`describe`). No torch, no Hydra here."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

INT64_MAX = 2**63 - 1
"""The largest int torch, numpy and the checkpoint's JSON round trip all take as a signed 64-bit value."""
SEED_MAX = 2**64 - 1
"""torch.manual_seed and numpy's generators take seeds up to 2**64 - 1."""


def key(default: Any, rule: Any, doc: str) -> Any:
    """A schema field that carries its rule and doc (`dataclasses.field` metadata, read by `keys`); a list or dict
    default is copied for each instance."""
    meta = {"rule": rule, "doc": doc}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def fmt_bound(bound: float) -> str:
    return "2**64 - 1" if bound == SEED_MAX else "2**63 - 1" if bound == INT64_MAX else f"{bound:g}"


@dataclass(frozen=True)
class Range:
    """The values a number may take: `low`..`high` (each end closed unless `*_open`), plus `also`."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    also: tuple[int, ...] = ()  # values allowed outside the range, e.g. -1 for "all"
    note: str = ""
    """What a special value means, e.g. "(0 disables)"."""

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return value in self.also or (above and below)

    def describe(self) -> str:
        if self.high == math.inf:
            text = f"must be {'>' if self.low_open else '>='} {fmt_bound(self.low)}"
        else:
            text = (f"must be in {'(' if self.low_open else '['}{fmt_bound(self.low)}, "
                    f"{fmt_bound(self.high)}{')' if self.high_open else ']'}")
        text += "".join(f" or {v}" for v in self.also)
        return f"{text} {self.note}" if self.note else text

    def problem(self, key: str, value: Any, default: Any = None) -> str | None:
        """Why `value` is no good here (a float that is not finite, an int beyond 64 bits, out of range), or None.
        Null, where the schema allows it, and a wrong type (the schema's to report) pass."""
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            return None
        example = f"; e.g. {key}={default}" if default is not None else ""
        if isinstance(value, float) and not math.isfinite(value):
            return f"{key}: must be a finite number, got {value}{example}"
        limit = SEED_MAX if self.high == SEED_MAX else INT64_MAX
        if isinstance(value, int) and not -INT64_MAX - 1 <= value <= limit:
            bounds = self.describe() + ("" if self.high != math.inf else f" and at most {fmt_bound(limit)}")
            return f"{key}: {value} does not fit in 64 bits; {bounds}{example}"
        return None if self.contains(value) else f"{key}: {self.describe()}, got {value}{example}"


POSITIVE = Range(low=0, low_open=True)
FRACTION = Range(low=0, high=1, high_open=True)  # [0, 1)


@dataclass(frozen=True)
class Choice:
    """One of `options`, or (without them) of the option names of the config group `group`."""

    options: tuple[str, ...] = ()
    group: str = ""

    def names(self) -> tuple[str, ...]:
        from llmexp.config.tree import option_names

        return self.options or option_names(self.group)

    def describe(self) -> str:
        return f"one of: {', '.join(self.names())}"

    def problem(self, key: str, value: Any, default: Any = None) -> str | None:
        if value is None or value in self.names():  # null only where the schema allows it
            return None
        return f"{key}: {value!r} is not one of {', '.join(self.names())}"


@dataclass(frozen=True)
class Text:
    """Free text passed on as it is. Unset (null) is allowed when `nullable`; set, it is not empty, at most
    `max_len` characters, and (when `one_line`) a single line: no tool that receives these takes an empty name,
    a newline inside one, or a megabyte of it."""

    nullable: bool = True
    max_len: int = 1000
    one_line: bool = True
    forbid: str = ""
    """Characters it may not hold (what the tool it is passed to refuses)."""
    public: bool = False
    """Shown in clear (a tracker's project or tags, a name in a path): a value holding a secret is refused, as the
    run's files are redacted but names are not."""

    def describe(self) -> str:
        none_of = f", none of {' '.join(self.forbid)}" if self.forbid else ""
        text = f"{'line of ' if self.one_line else ''}text (at most {self.max_len} characters{none_of}"
        text += ", no secret)" if self.public else ")"
        return f"a {text}, or null" if self.nullable else f"a non-empty {text}"

    def problem(self, key: str, value: Any, default: Any = None) -> str | None:
        if value is None:
            return None if self.nullable else f"{key}: must be set"
        text = str(value)
        if self.public and holds_secret(text):  # first: no other message may echo it
            return f"{key}: {SECRET_IN_NAME}"
        if not text.strip():
            return f"{key}: must not be empty" + ("; leave it out (null) instead" if self.nullable else "")
        if len(text) > self.max_len:
            return f"{key}: is {len(text)} characters long; at most {self.max_len}"
        if self.one_line and ("\n" in text or "\r" in text):
            return f"{key}: must be one line"
        if found := [c for c in self.forbid if c in text]:
            return (f"{key}: {text!r} holds {' '.join(found)}; it may hold none of {' '.join(self.forbid)}"
                    + (f"; e.g. {key}={default}" if default else ""))
        return None


SECRET_IN_NAME = ("holds a secret (an API key or token, e.g. from ${oc.env:...}); it is shown in clear (file names, "
                  "the tracker's pages), so give it a plain name")


def holds_secret(text: str) -> bool:
    """Whether a name holds a secret: a credential-named variable's value or a token-shaped string."""
    from llmexp.rundir.redact import scrub_text

    return scrub_text(text) != text


LABEL, OPTIONAL = Text(nullable=False), Text()


@dataclass(frozen=True)
class TextList:
    """A list of `item`s."""

    item: Text

    def describe(self) -> str:
        return f"a list, each item {self.item.describe()}"

    def problem(self, key: str, value: Any, default: Any = None) -> str | None:
        if isinstance(value, str):  # e.g. from ${oc.env:...}; not echoed, it may be a secret
            return f"{key}: must be a list, not a string; e.g. {key}=[a,b]"
        for i, item in enumerate(value or []):
            if isinstance(item, str) and not item.strip():
                return f"{key}[{i}]: must not be empty; remove it from the list"
            if problem := self.item.problem(f"{key}[{i}]", item):
                return problem
        return None


@dataclass(frozen=True)
class Flag:
    """true or false: the schema's boolean type is the whole rule."""

    def describe(self) -> str:
        return "true or false"

    def problem(self, key: str, value: Any, default: Any = None) -> str | None:
        return None


FLAG = Flag()

PATH_KINDS = {
    "dir_out": "a directory llmexp creates and writes, not the filesystem's root: if it exists it is a directory, "
               "and so is its nearest existing parent; no name in it longer than the filesystem allows",
    "data_file": "data=json: an existing, non-empty JSON/JSONL file; data=text: a non-empty file, a directory "
                 "holding non-empty files (hidden ones skipped, and hidden directories), or a glob matching some",
    "model": "a local model directory (config.json and safetensors weights, no code unless trusted), or a hub id",
    "tokenizer": "a local tokenizer directory (no code unless trusted), or a hub id",
    "checkpoint": "auto, never, or an existing checkpoint directory",
    "hf_source": "data=hf: a hub id, a save_to_disk directory, or a file builder (parquet, arrow, json, csv, text); "
                 "never a loading script",
    "hf_files": "data=hf: a file, glob or list of them, each matching non-empty files",
    "task_dir": "an existing directory holding lm-evaluation-harness task YAMLs (*.yaml)",
}
"""What each kind of path key names; `paths.KIND_CHECKS` checks them before anything is written."""

PATH_MAX = 4096
"""Linux's longest path (PATH_MAX)."""


@dataclass(frozen=True)
class PathRule:
    """A file or directory (`PATH_KINDS`), checked on this machine before anything is written
    (`paths.KIND_CHECKS`); what needs no machine (set but empty, longer than a path can be) is `problem`'s."""

    kind: str

    def describe(self) -> str:
        return PATH_KINDS[self.kind]

    def problem(self, key: str, value: Any, default: Any = None) -> str | None:
        if value is None or not isinstance(value, str):
            return None  # unset; a list of files (data.data_files) is judged on the machine
        if not value.strip():
            fix = "leave it out (null), or name a path" if default is None else f"set it to {self.describe()}"
            return f"{key}: must not be empty; {fix}"
        if len(value) > PATH_MAX:
            return f"{key}: is {len(value)} characters long; no path is longer than {PATH_MAX}"
        return None


@dataclass(frozen=True)
class Special:
    """A value with a rule of its own (`text`, in words), checked by the function that knows it; `bad` are values it
    refuses (override syntax); `sweep_only`: read only by a sweep, so checked before one launches (`sweep.check`)."""

    text: str
    bad: tuple[str, ...] = ()
    sweep_only: bool = False

    def describe(self) -> str:
        return self.text

    def problem(self, key: str, value: Any, default: Any = None) -> str | None:
        return None  # (its own function reports it)
