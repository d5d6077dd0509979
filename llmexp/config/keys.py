"""The schema's keys: every dotted key, did-you-mean suggestions, leaf types, group options; and whether a
composed config holds only keys the schema knows, every one set and resolvable (`structure_errors`)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, nodes
from omegaconf.errors import OmegaConfBaseException, ValidationError

from llmexp.config import security
from llmexp.config.schema import Config, LauncherSettings, SweeperSettings
from llmexp.config.tree import conf_dir


def _unwrap(tp: Any) -> Any:
    """`X | None` -> X."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else Any
    return tp


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    """A dataclass's annotations, evaluated once (`get_type_hints` evaluates every string again on each call, and
    validating one config asks ~300 times)."""
    return typing.get_type_hints(cls)


@functools.cache
def node_fields(cls: Any) -> dict[str, Any] | None:
    """A schema node's fields and their types (`| None` removed), or None below a free-form node (dict, list,
    Any). The schema is fixed for the life of the process; callers only read the dict."""
    return {k: _unwrap(v) for k, v in _hints(cls).items()} if dataclasses.is_dataclass(cls) else None


@dataclass(frozen=True)
class Leaf:
    """A leaf of the schema as its field declares it (`rules.key`); `type` is its annotation with `| None` removed."""

    key: str
    type: Any
    annotation: Any
    default: Any
    rule: Any
    doc: str


@dataclass(frozen=True)
class KeyDoc:
    """One key of the schema in words, for the docs reference and `--help`: its dotted `key` ("train.max_steps"),
    `type` ("int", "str | null", "list[str]", "dict", ...), `default` (plain Python, None for null), `rule` ("must
    be >= 1 or -1 (-1 trains for train.num_train_epochs)", "one of: adamw, ...") and `doc`."""

    key: str
    type: str
    default: Any
    rule: str
    doc: str


def leaves_of(cls: Any, prefix: str = "", entries: bool = False) -> Iterator[Leaf]:
    """Every leaf below the schema node `cls`, in schema order; with `entries`, also the fields of the entries of
    a dict of nodes (`eval.generate.<name>.max_new_tokens`)."""
    for f in dataclasses.fields(cls):
        tp, annotation = node_fields(cls)[f.name], _hints(cls)[f.name]  # type: ignore[index]
        if dataclasses.is_dataclass(tp):
            yield from leaves_of(tp, f"{prefix}{f.name}.", entries)
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        yield Leaf(prefix + f.name, tp, annotation, None if default is dataclasses.MISSING else default,
                   f.metadata.get("rule"), f.metadata.get("doc", ""))
        if entries and dataclasses.is_dataclass(entry := entry_node(tp)):
            yield from leaves_of(entry, f"{prefix}{f.name}.<name>.", entries)


def entry_node(tp: Any) -> Any:
    """The node of each entry of a `dict[str, Node]` field, else None."""
    args = typing.get_args(tp)
    return args[1] if typing.get_origin(tp) is dict and dataclasses.is_dataclass(args[1]) else None


@functools.cache
def leaves() -> dict[str, Leaf]:
    """Every leaf of `schema.Config`, by dotted key, in schema order."""
    return {leaf.key: leaf for leaf in leaves_of(Config)}


MIRRORS = {"hydra.launcher.": "cluster.", "hydra.sweeper.": "sweep."}
"""The launchers' and sweepers' settings that are llmexp's `cluster.*` and `sweep.*` under another name."""


@functools.cache
def hydra_leaves() -> dict[str, Leaf]:
    """The launchers' and sweepers' settings that no `cluster.*` / `sweep.*` key mirrors, by dotted key."""
    nodes = {"hydra.launcher.": LauncherSettings, "hydra.sweeper.": SweeperSettings}
    return {leaf.key: leaf for prefix, node in nodes.items() for leaf in leaves_of(node, prefix)}


def leaf_for(key: str) -> Leaf | None:
    """The leaf that describes `key`: a schema leaf, or a launcher's or sweeper's setting (its own, or the
    `cluster.*` / `sweep.*` leaf it mirrors); None for anything else."""
    if key in hydra_leaves():
        return hydra_leaves()[key]
    for prefix, mirrored in MIRRORS.items():
        if key.startswith(prefix):
            return leaves().get(mirrored + key[len(prefix):])
    return leaves().get(key)


def reference() -> list[KeyDoc]:
    """Every leaf of the schema (with the entries of a dict of nodes), then `hydra_leaves`, each in words: the
    docs' config reference."""
    return [KeyDoc(leaf.key, type_words(leaf.annotation), leaf.default, leaf.rule.describe(), leaf.doc)
            for leaf in [*leaves_of(Config, entries=True), *hydra_leaves().values()]]


def type_words(tp: Any) -> str:
    """A field's annotation as a reader writes it: `int`, `str | null`, `list[str]`, `dict`."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_words(a) for a in args)
    if typing.get_origin(tp) is list:
        return f"list[{'dict' if dataclasses.is_dataclass(args[0]) else type_words(args[0])}]"
    if typing.get_origin(tp) is dict:
        return "dict"
    return "any" if tp is Any else getattr(tp, "__name__", str(tp))


def unknown_key(key: str) -> str | None:
    """None if the schema knows `key` (or it lies under a free-form dict); else a message with a suggestion."""
    node: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = node_fields(node)
        if fields is None:
            return None
        if part not in fields:
            return f"{key}: no such key; {_suggest(parts, i, fields)}"
        node = fields[part]
    return None


def type_problem(key: str, value: Any) -> str | None:
    """A value of the wrong type for an int, float or bool field (Hydra would say it less plainly)."""
    kinds = {int: ("an integer", nodes.IntegerNode), float: ("a number", nodes.FloatNode),
             bool: ("true or false", nodes.BooleanNode)}
    leaf = leaves().get(key)
    if leaf is None or value is None or leaf.type not in kinds:
        return None
    words, node_class = kinds[leaf.type]
    try:
        node_class(value)  # exactly what OmegaConf will accept at compose time
    except ValidationError:
        if leaf.default is None:  # an optional number: unset by default
            return f"{key}={value}: must be {words} or null (unset, the default)"
        example = str(leaf.default).lower() if isinstance(leaf.default, bool) else leaf.default
        return f"{key}={value}: must be {words}, e.g. {key}={example}"
    return None


def _suggest(parts: list[str], i: int, fields: dict[str, Any]) -> str:
    prefix = ".".join(parts[:i])
    if close := difflib.get_close_matches(parts[i], list(fields), n=1, cutoff=0.6):
        return f"did you mean {prefix + '.' if prefix else ''}{close[0]}?"
    for key in leaves():  # the first key, node or leaf, of that name
        found = key.split(".")
        if parts[i] in found:
            return f"did you mean {'.'.join(found[:found.index(parts[i]) + 1])}?"
    return f"{prefix or 'the top level'} has {', '.join(fields)} (python -m llmexp --cfg job shows every key)"


def group_options(group: str) -> list[str] | None:
    """The options of a config group (`llmexp/conf/<group>/*.yaml`), or None if `group` is not a group."""
    directory = conf_dir() / group
    return sorted(p.stem for p in directory.glob("*.yaml")) if directory.is_dir() else None


def structure_errors(cfg: Any) -> list[str]:
    """Problems that make the config's values unreadable or untrusted; checked before any value is.

    A `hydra` node (configs composed with `return_hydra_config=True`) is Hydra's and is skipped."""
    data = OmegaConf.to_container(cfg, resolve=False)
    data.pop("hydra", None)  # type: ignore[union-attr]
    strings = security.find_values(data, pick=lambda key, value: isinstance(value, str))
    errors = [f"{key}: is required but left unset (??? in the config); set {key}=..."
              for key, value in strings if value == "???"]
    errors += _unknown_keys(data)
    errors += [f"{key}: contains a NUL byte; remove it" for key, value in strings if "\x00" in value]
    errors += security.target_errors(data)  # type: ignore[arg-type]
    return errors or _interpolation_errors(cfg)


def _interpolation_errors(cfg: Any) -> list[str]:
    """Resolve every value now (env variables, `${...}` references), not halfway through a run."""
    errors = []
    for key in [k for k in cfg if k != "hydra"]:
        try:
            node = cfg[key]
            if isinstance(node, DictConfig):
                OmegaConf.to_container(node, resolve=True)
        except OmegaConfBaseException as err:
            errors.append(f"{err.full_key or key}: {security.unresolved(err)}")
    return errors


def _unknown_keys(data: Any, prefix: str = "") -> list[str]:
    errors = []
    for key, value in data.items() if isinstance(data, dict) else []:
        dotted = f"{prefix}{key}"
        if problem := unknown_key(dotted):
            errors.append(problem + " (added with +? remove it)")
        elif isinstance(value, dict):
            errors.extend(_unknown_keys(value, dotted + "."))
    return errors
