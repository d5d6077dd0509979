"""What Python a folder of harness task YAMLs (`eval.lm_eval.include_path`) would run, found before it runs: the
places docs/explanation/security-model.md lists ("Harness task folders"). A `!function` tag imports the module
it names and calls it; Jinja templates count because lm-evaluation-harness renders them in a non-sandboxed Jinja
environment. YAMLs inside the installed harness's own task tree are code the user installed: an `include:` of one
is not followed. Nothing here imports the harness or runs a template: YAML is composed with PyYAML's safe loader
(a tag is recorded, never constructed) and templates are parsed, not rendered, by Jinja.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmexp.rundir.readers import entry_of, parse_yaml, read_text, reader

JINJA_GLOBALS = frozenset({"lipsum", "cycler", "joiner", "namespace", "self"})
"""Objects every template of a default Jinja environment can reach, each a way to Python's globals."""


@dataclass(frozen=True)
class _Code:
    """A `!function` tag: what it names and where."""

    name: str
    line: int


class _TaskLoader(yaml.SafeLoader):
    """The safe loader plus the harness's `!function` tag, recorded (never imported)."""

    def _function(self, node: yaml.Node) -> _Code:
        return _Code(str(self.construct_scalar(node)), node.start_mark.line + 1)


_TaskLoader.add_constructor("!function", _TaskLoader._function)


@reader
def read_task_yaml(path: Path) -> Any:
    """A harness task YAML as data, its `!function` tags as `_Code` markers (None for an empty file)."""
    text = read_text(path, entry_of(read_task_yaml).max_bytes)
    return parse_yaml(text, path, lambda t: yaml.load(t, Loader=_TaskLoader))  # the safe loader, one tag recorded


def code_in_task_dir(folder: Path) -> list[str]:
    """`file:line: what` for each place a task YAML under `folder` (or a YAML it includes) would run code."""
    found: list[str] = []
    seen: set[Path] = set()
    for path in sorted([*folder.rglob("*.yaml"), *folder.rglob("*.yml")]):
        _scan(path, seen, found)
    return found


def _scan(path: Path, seen: set[Path], found: list[str]) -> None:
    path = path.resolve()
    if path in seen or _installed(path):
        return
    seen.add(path)
    data = read_task_yaml(path)
    for where, value in _leaves(data):
        if isinstance(value, _Code):
            found.append(f"{path}:{value.line}: `{where}: !function {value.name}` imports and runs Python")
        elif isinstance(value, str) and (why := _template_code(value)):
            found.append(f"{path}: `{where}` is a Jinja template that {why}")
    includes = data.get("include") if isinstance(data, dict) else None
    for include in includes if isinstance(includes, list) else [includes] if includes else []:
        if isinstance(include, str):
            _scan(path.parent / include, seen, found)  # (an absolute include replaces path.parent)


def _leaves(value: Any, where: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, list):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{where}[{i}]")]
    return [(where, value)]


def _template_code(text: str) -> str | None:
    """Why a Jinja template could run code (None: it only reads the document's fields)."""
    if "{{" not in text and "{%" not in text:
        return None
    from jinja2 import Environment, TemplateSyntaxError, nodes

    try:
        tree = Environment().parse(text)
    except TemplateSyntaxError:
        return None  # the harness will refuse it; it runs nothing
    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter, nodes.Name)):
        if isinstance(node, nodes.Getattr) and node.attr.startswith("_"):
            return f"reads the private attribute {node.attr}"
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and str(node.arg.value)[:1] == "_":
            return f"reads the private item {node.arg.value}"
        if isinstance(node, nodes.Filter) and node.name == "attr":
            return "uses the attr filter"
        if isinstance(node, nodes.Name) and node.name in JINJA_GLOBALS:
            return f"reaches Jinja's global {node.name}"
    return None


def _installed(path: Path) -> bool:
    """Whether `path` lies in the installed harness's own task tree (code the user installed)."""
    spec = importlib.util.find_spec("lm_eval")
    roots = [Path(p).resolve() / "tasks" for p in (spec.submodule_search_locations or [])] if spec else []
    return any(path.is_relative_to(root) for root in roots)
