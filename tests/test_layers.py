"""The package's layers (README, "Code map"): no module imports a layer above its own, and the imports
between llmexp's modules form no cycle. Every import counts, at the top of a file, inside a function or
under `if TYPE_CHECKING:`: an annotation-only import still says one module needs the other, so a loop
closed by annotations alone is a loop in the design."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

ENTRY_POINTS = ("llmexp.__main__", "llmexp.doctor", "llmexp.estimate", "llmexp.status", "llmexp.lr_find",
                "llmexp.fit", "llmexp.coord_check")
"""`python -m llmexp[.X]` needs a module at llmexp/X.py: each is three lines handing over to its command in `cli/`
(or `report/`), so it belongs to the cli layer."""

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("llmexp", "llmexp.errors")),
    ("rundir", ("llmexp.rundir",)),
    ("config", ("llmexp.config",)),
    ("machine", ("llmexp.machine",)),
    ("data", ("llmexp.data",)),
    ("model", ("llmexp.model",)),
    ("evals", ("llmexp.evals",)),
    ("checkpoint", ("llmexp.checkpoint",)),
    ("monitor", ("llmexp.monitor",)),
    ("report", ("llmexp.report",)),
    ("train", ("llmexp.train",)),
    ("sweep", ("llmexp.sweep", "hydra_plugins")),
    ("cli", ("llmexp.cli", *ENTRY_POINTS)),
)
"""Lowest first. A module belongs to the layer of the longest prefix that names it."""


def layer_of(module: str) -> int:
    matches = [(len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    if not matches:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layers.py")
    return max(matches)[1]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement anywhere in the file, `if TYPE_CHECKING:` blocks included."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports (`from pkg import mod` counts as pkg.mod)."""
    files = {module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{src} ({LAYERS[layer_of(src)][0]}) imports {dst} ({LAYERS[layer_of(dst)][0]})"
                  for src, dsts in graph.items() for dst in dsts if layer_of(dst) > layer_of(src))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(REPO, ("llmexp", "hydra_plugins"))


def test_every_module_is_in_a_layer(graph: dict[str, set[str]]) -> None:
    for module in graph:
        layer_of(module)


def test_no_module_imports_a_layer_above_its_own(graph: dict[str, set[str]]) -> None:
    assert upward_edges(graph) == []


def test_the_imports_form_no_cycle(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def test_the_checker_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    """The checker itself: a function-level upward import and a cycle are caught, and so is a cycle that only
    annotations close (`if TYPE_CHECKING:` imports count)."""
    pkg = tmp_path / "llmexp"
    (pkg / "train").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train" / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("def f():\n    from llmexp.train import train\n")  # base -> train: upward
    (pkg / "train" / "train.py").write_text("from llmexp.train import engine\n")
    (pkg / "train" / "engine.py").write_text("from . import train\n")  # a cycle through a relative import
    (pkg / "train" / "state.py").write_text("from llmexp.train import suite\n")
    (pkg / "train" / "suite.py").write_text(  # closed by an annotation-only import
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from llmexp.train.state import Run\n")
    found = import_graph(tmp_path, ("llmexp",))
    assert upward_edges(found) == ["llmexp.errors (base) imports llmexp.train.train (train)"]
    assert sorted(cycles(found)) == [["llmexp.train.engine", "llmexp.train.train"],
                                     ["llmexp.train.state", "llmexp.train.suite"]]
