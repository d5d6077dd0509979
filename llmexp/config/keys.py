"""The schema's keys: every dotted key, did-you-mean suggestions, leaf types, group options; and whether a
composed config holds only keys the schema knows, every one set and resolvable (`structure_errors`)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterator
from typing import Any

from llmexp.config import security


def _unwrap(tp: Any) -> Any:
    """`X | None` -> X."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else Any
    return tp


@functools.cache
def node_fields(cls: Any) -> dict[str, Any] | None:
    """A schema node's fields and their types (`| None` removed), or None below a free-form node (dict, list,
    Any). The one reading of the schema's dataclasses: every walk below, and `validation`'s, goes through it.

    Cached: `get_type_hints` evaluates every annotation string again on each call, and validating one config
    asks ~300 times (validation then took ~0.2 s; a sweep's check and the property tests pay it per config).
    The schema is fixed for the life of the process; callers only read the dict."""
    return {k: _unwrap(v) for k, v in typing.get_type_hints(cls).items()} if dataclasses.is_dataclass(cls) else None


def _walk(cls: Any = None, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field[Any]]]:
    """Every field of the schema, nodes before their fields: (dotted key, type, the dataclass field)."""
    from llmexp.config.schema import Config

    cls = Config if cls is None else cls
    types_ = node_fields(cls) or {}
    for field in dataclasses.fields(cls):
        key, tp = prefix + field.name, types_[field.name]
        yield key, tp, field
        if dataclasses.is_dataclass(tp):
            yield from _walk(tp, f"{key}.")


@functools.cache
def _schema() -> dict[str, tuple[Any, dataclasses.Field[Any]]]:
    """The walk, once per process: dotted key -> (type, dataclass field)."""
    return {key: (tp, field) for key, tp, field in _walk()}


def all_keys() -> list[str]:
    """Every dotted key of the schema (`train`, `train.max_steps`, ...)."""
    return list(_schema())


def schema_fields() -> dict[str, tuple[Any, Any]]:
    """Every leaf of the schema: dotted key -> (type, default or None)."""
    return {key: (tp, None if field.default is dataclasses.MISSING else field.default)
            for key, (tp, field) in _schema().items() if not dataclasses.is_dataclass(tp)}


def unknown_key(key: str) -> str | None:
    """None if the schema knows `key` (or it lies under a free-form dict); else a message with a suggestion."""
    from llmexp.config.schema import Config

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


def _leaf(key: str) -> tuple[Any, Any] | None:
    """(type, default) of a schema leaf (`train.max_steps` -> (int, 300)); None for nodes, unknown keys and
    fields without a plain default."""
    found = _schema().get(key)
    if found is None or dataclasses.is_dataclass(found[0]) or found[1].default is dataclasses.MISSING:
        return None
    return found[0], found[1].default


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false"}


def _type_problem(key: str, value: Any) -> str | None:
    """A value of the wrong type for an int, float or bool field (Hydra would say it less plainly)."""
    leaf = _leaf(key)
    if leaf is None or value is None or leaf[0] not in _TYPE_WORDS:
        return None
    from omegaconf import nodes
    from omegaconf.errors import ValidationError

    tp, default = leaf
    node_class = {int: nodes.IntegerNode, float: nodes.FloatNode, bool: nodes.BooleanNode}[tp]
    try:
        node_class(value)  # exactly what OmegaConf will accept at compose time
        return None
    except ValidationError:
        pass
    example = str(default).lower() if isinstance(default, bool) else default
    return f"{key}={value}: must be {_TYPE_WORDS[tp]}, e.g. {key}={example}"


def _suggest(parts: list[str], i: int, fields: dict[str, Any]) -> str:
    prefix = ".".join(parts[:i])
    close = difflib.get_close_matches(parts[i], list(fields), n=1, cutoff=0.6)
    if close:
        return f"did you mean {prefix + '.' if prefix else ''}{close[0]}?"
    elsewhere = [k for k in all_keys() if k.rsplit(".", 1)[-1] == parts[i]]
    if elsewhere:
        return f"did you mean {elsewhere[0]}?"
    return f"{prefix or 'the top level'} has {', '.join(fields)} (python -m llmexp --cfg job shows every key)"


def group_options(group: str) -> list[str] | None:
    """The options of a config group (`llmexp/conf/<group>/*.yaml`), or None if `group` is not a group."""
    from llmexp.config.tree import conf_dir

    directory = conf_dir() / group
    return sorted(p.stem for p in directory.glob("*.yaml")) if directory.is_dir() else None


def structure_errors(cfg: Any) -> list[str]:
    """Problems that make the config's values unreadable or untrusted; checked before any value is.

    A `hydra` node (configs composed with `return_hydra_config=True`) is Hydra's and is skipped."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    data = OmegaConf.to_container(cfg, resolve=False)
    data.pop("hydra", None)  # type: ignore[union-attr]
    missing = [key for key, value in _strings(data) if value == "???"]
    errors = [f"{key}: is required but left unset (??? in the config); set {key}=..." for key in missing]
    errors += _unknown_keys(data)
    errors += [f"{key}: contains a NUL byte; remove it" for key, value in _strings(data) if "\x00" in value]
    errors += security.target_errors(data)  # type: ignore[arg-type]
    return errors if errors or missing else _interpolation_errors(cfg)


def _interpolation_errors(cfg: Any) -> list[str]:
    """Resolve every value now (env variables, `${...}` references), not halfway through a run."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    errors = []
    for key in cfg:
        if key == "hydra":
            continue
        try:
            node = cfg[key]
            if isinstance(node, DictConfig):
                OmegaConf.to_container(node, resolve=True)
        except OmegaConfBaseException as err:
            reason = str(err.msg).splitlines()[0]
            errors.append(f"{err.full_key or key}: cannot resolve an interpolation ({reason}); "
                          "fix the ${...} reference or set the environment variable it reads")
    return errors


def _unknown_keys(data: Any, prefix: str = "") -> list[str]:
    errors = []
    for key, value in data.items() if isinstance(data, dict) else []:
        dotted = f"{prefix}{key}"
        problem = unknown_key(dotted)
        if problem:
            errors.append(problem + " (added with +? remove it)")
        elif isinstance(value, dict):
            errors.extend(_unknown_keys(value, dotted + "."))
    return errors


def _strings(data: Any, prefix: str = "") -> list[tuple[str, str]]:
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else []
    out = []
    for key, value in items:
        dotted = f"{prefix}{key}"
        if isinstance(value, str):
            out.append((dotted, value))
        else:
            out.extend(_strings(value, dotted + "."))
    return out
