"""Every file llmexp reads goes through a reader registered in `llmexp.rundir.readers`, and each kind of reader
keeps its promise on damaged files (the "Bad input" rules):

- an INPUT reader raises UserError naming the file (and the line, where the damage has one);
- a CACHE reader returns None (a miss) and says so in one line at most;
- a RECORD reader returns None or what it could read, and says in one line what it skipped;
- none hangs (a FIFO), fills memory (a link to /dev/zero) or raises anything else.

`test_no_file_is_read_outside_the_registry` scans llmexp/ and hydra_plugins/ for file reads (open, read_text,
json.load, yaml.safe_load, np.load, torch.load, ...) in any function the registry does not list.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmexp.errors import UserError
from llmexp.rundir import readers
from llmexp.rundir.readers import CACHE, INPUT, OTHER_OPENS, READERS, RECORD, Need
from tests.conftest import REPO, as_nobody

# ----------------------------------------------------------------------------- no read outside the registry

PRIMITIVES = {"read_text", "read_bytes", "read_lines", "open_regular", "load_json", "load_yaml"}
"""The registry's own primitives (`llmexp.rundir.readers`); `Path.read_text` and `Path.read_bytes` count too."""
LOADERS = {"json", "np", "numpy", "torch", "pickle", "cloudpickle", "OmegaConf", "yaml"}
"""Modules whose `load` (`safe_load`) reads a file."""
READ_CALLS = {"memmap", "safe_open", "load_file", "GGUFReader"}
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}


def _reads(call: ast.Call, primitives: set[str]) -> bool:
    """Whether a call reads a file (a write-mode `open` or `os.open` does not; a call of a reader does not)."""
    func = call.func
    if isinstance(func, ast.Name):
        if func.id == "open":
            mode = next(iter(call.args[1:2]), next((k.value for k in call.keywords if k.arg == "mode"), None))
            return not (isinstance(mode, ast.Constant) and any(c in str(mode.value) for c in "wax+"))
        return func.id in READ_CALLS or func.id in primitives
    if not isinstance(func, ast.Attribute):
        return False
    owner = func.value.id if isinstance(func.value, ast.Name) else None
    if func.attr == "open" and owner == "os":
        return not {n.attr for n in ast.walk(call.args[1]) if isinstance(n, ast.Attribute)} & WRITE_FLAGS
    return (func.attr in ("load", "safe_load") and owner in LOADERS) or func.attr in READ_CALLS \
        or func.attr in ("read_text", "read_bytes") or (owner == "readers" and func.attr in PRIMITIVES)


def file_reads(root: Path) -> Iterator[tuple[str, int, str]]:
    """(`module:qualname` of the innermost function around it, line, call) of every file read under `root`."""
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(), str(path))
        primitives = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                      and n.module == "llmexp.rundir.readers" for a in n.names if a.name in PRIMITIVES}
        yield from _visit(tree, [], module, primitives)


def _visit(node: ast.AST, scope: list[str], module: str, primitives: set[str]) -> Iterator[tuple[str, int, str]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _visit(child, [*scope, child.name, "<locals>"], module, primitives)
        elif isinstance(child, ast.ClassDef):
            yield from _visit(child, [*scope, child.name], module, primitives)
        else:
            if isinstance(child, ast.Call) and _reads(child, primitives):
                where = ".".join(scope[:-1] if scope and scope[-1] == "<locals>" else scope) or "<module>"
                yield f"{module}:{where}", child.lineno, ast.unparse(child.func)
            yield from _visit(child, scope, module, primitives)


def test_no_file_is_read_outside_the_registry() -> None:
    """The next feature that reads a file registers its reader, with a kind, or fails here."""
    found = [read for root in ("llmexp", "hydra_plugins") for read in file_reads(REPO / root)]
    outside = [f"{where} (line {line}: {call})" for where, line, call in found
               if where not in READERS and where not in OTHER_OPENS
               and not where.startswith("llmexp.rundir.readers:")]
    assert not outside, ("files read outside a registered reader: register each in llmexp.rundir.readers.READERS "
                         "(INPUT, CACHE or RECORD) and decorate it with @reader:\n  " + "\n  ".join(outside))
    assert len(found) > 25  # the scan sees the reads it should


def test_every_registered_reader_exists_and_carries_its_duty() -> None:
    for name, entry in {**READERS, **dict.fromkeys(OTHER_OPENS)}.items():
        module, _, qualname = name.partition(":")
        source = ast.parse((REPO / (module.replace(".", "/") + ".py")).read_text())
        names = {".".join(p for p in q.split(".")) for q in _qualnames(source)}
        assert qualname in names, f"{name} is registered but does not exist"
        if entry is not None and entry.duty is None:
            fn = _resolve(name)
            assert getattr(fn, "__wrapped__", None) is not None, f"{name} is registered but not decorated @reader"
        if entry is not None and entry.duty is not None:  # the function said to handle what this one reads
            assert callable(_resolve(entry.duty)), f"{name}'s duty {entry.duty} does not exist"
    assert {e.kind for e in READERS.values()} == {INPUT, CACHE, RECORD}


def _qualnames(tree: ast.AST, scope: str = "") -> Iterator[str]:
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.FunctionDef | ast.ClassDef):
            name = f"{scope}{child.name}"
            yield name
            yield from _qualnames(child, f"{name}.<locals>." if isinstance(child, ast.FunctionDef) else f"{name}.")
        else:
            yield from _qualnames(child, scope)


def _resolve(name: str) -> Callable[..., Any]:
    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# ----------------------------------------------------------------------------- every reader fed damaged files


def _gguf() -> bytes:
    """A whole GGUF file of one F32 tensor, written by the gguf package as llama.cpp lays it out."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        w = gguf.GGUFWriter(f"{tmp}/m.gguf", "llama")
        w.add_tensor("output_norm.weight", np.ones(32, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return Path(f"{tmp}/m.gguf").read_bytes()


def _pickle() -> bytes:
    import cloudpickle

    return cloudpickle.dumps({"spec": [1, 2]})


FINDING = {"kind": "spike", "step": 3, "severity": "warning", "message": "m", "advice": "a"}
SAMPLES: dict[str, tuple[str, Callable[[], bytes], tuple[Any, ...]]] = {
    "llmexp.data.corpora:read_json_records": ("jsonl", lambda: b'{"text": "a"}\n{"prompt": "p", "completion": "c"}\n',
                                              ()),
    "llmexp.data.corpora:read_text": ("text", lambda: b"def f():\n    return 1\n", ()),
    "llmexp.data.corpora:read_source": ("text", lambda: b"x = 1\n", ()),
    "llmexp.evals.items:_json_lines": ("jsonl", lambda: b'{"context": "c", "choices": ["a", "b"], "answer": 1}\n',
                                       ("eval.multiple_choice.x.file",)),
    "llmexp.machine.gguf:read_architecture": ("bytes", _gguf, ()),
    "llmexp.config.origin:read_config_yaml": ("yaml", lambda: b"lr: 0.1\ntrain:\n  max_steps: 3\n", ()),
    "llmexp.machine.task_code:read_task_yaml": ("yaml", lambda: b"task: t\ndataset_path: json\n"
                                               b"process_docs: !function utils.process\n", ()),
    "llmexp.machine.paths:read_tokenizer_size": ("json", lambda: json.dumps({
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 2, "content": "<s>"}]}).encode(),
        ()),
    "llmexp.machine.paths:read_model_json": ("json", lambda: b'{"model_type": "llama", "hidden_size": 8}', ()),
    "llmexp.train.lr_find:read_lr_find": ("json", lambda: json.dumps({
        "suggestion": 1e-4, "lr_find_steps": 20, "lr_find_start": 1e-7, "lr_find_end": 1.0, "curve": []}).encode(),
        ()),
    "llmexp.model.cpu_matmul:read_verdicts": ("json", lambda: json.dumps({"k": {
        "path": "torch", "reason": "r", "speedup": 0.9, "max_rel_diff": 0.0}}).encode(), ()),
    "llmexp.monitor.throughput:load_ceilings": ("json", lambda: b'{"v2|cpu|torch.float32|2": 0.4}', ()),
    "llmexp.data.cache:load_meta": ("json", lambda: b'{"key": "k", "files": {"a.npy": [3, "ab12"]}}', ()),
    "llmexp.rundir.read:read_metrics": ("jsonl", lambda: b'{"step": 0, "event": "eval", "eval_loss": 2.5}\n'
                                        b'{"step": 1, "event": "train", "loss": 2.0, "time_s": 0.1}\n', ()),
    "llmexp.rundir.read:read_summary": ("json", lambda: json.dumps({
        "status": "completed", "step": 3, "eval_loss": 2.0, "findings": [FINDING], "overrides": ["lr=1"]}).encode(),
        ()),
    "llmexp.rundir.read:read_job_status": ("json", lambda: b'{"status": "failed", "exit_code": 1, "error": "e", '
                                           b'"job_id": null, "overrides": ["lr=1"]}', ()),
    "llmexp.rundir.read:read_slurm_jobs": ("json", lambda: b'{"jobs": {"0": "17_0"}, "submitit_folder": "/x"}', ()),
    "llmexp.rundir.readers:read_yaml": ("yaml", lambda: b"- lr=1\n- batch_size=2\n", ()),
    "llmexp.rundir.tracking:read_run_file": ("json", lambda: b'{"tracking_uri": "sqlite:///m.db", '
                                             b'"experiment_id": "1", "run_id": "ab"}', ()),
    "llmexp.rundir.lock:lock_pid": ("text", lambda: b"4242\n", ()),
    "llmexp.rundir.lock:read_hydra_file": ("bytes", lambda: b"lr: 0.1\n", ()),
    "llmexp.rundir.study:read_journal": ("bytes", lambda: b'{"op_code": 0, "worker_id": "w"}\n', ()),
    "llmexp.sweep.local:read_outcome": ("json", lambda: b'{"num": 0, "status": "completed", "exit_code": 0, '
                                        b'"error": null, "job_id": null}', ()),
    "llmexp.sweep.local:read_pickle": ("bytes", _pickle, ()),
}
"""A good file for every `@reader` (a new reader without one fails `test_every_reader_has_a_sample`)."""

FED = [name for name, entry in READERS.items() if entry.duty is None]
JSON_VALUES = [None, True, 7, 2.5, "s", [1], {"a": 1}]


@pytest.fixture(scope="module")
def shared_dir() -> Iterator[Path]:
    """A directory every user can enter, so that a reader run as `nobody` meets the file's own mode 000."""
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        yield Path(tmp)


def test_every_reader_has_a_sample() -> None:
    assert sorted(SAMPLES) == sorted(FED)


def _feed(name: str, path: Path, caplog: pytest.LogCaptureFixture, nobody: bool = False) -> tuple[Any, list[str]]:
    """(what the reader returned, or the exception it raised; the lines it said)."""
    readers._said.clear()
    caplog.clear()
    fn = _resolve(name)
    with caplog.at_level(logging.DEBUG, logger="llmexp.readers"), as_nobody() if nobody else contextlib.nullcontext():
        try:
            out: Any = fn(path, *SAMPLES[name][2])
        except Exception as err:  # what the kind allows is judged by `_kept`
            out = err
    return out, [r.getMessage() for r in caplog.records]


def _kept(name: str, path: Path, out: Any, lines: list[str], damaged: bool) -> None:
    """The kind's promise for `out` (a value or an exception) and `lines`; `damaged`: the reader must notice."""
    kind, shown = READERS[name].kind, str(path)
    if isinstance(out, Exception):
        assert kind == INPUT and isinstance(out, UserError), f"{name} raised {type(out).__name__}: {out}"
        assert shown in str(out), f"{name}: the error does not name the file: {out}"
        fix = READERS[name].fix  # e.g. "UTF-8 text": "...: it is not UTF-8 text (...); save it as UTF-8" says it
        assert not fix or str(out).count(fix) <= 1, f"{name}: the error says its fix {str(out).count(fix)} times: {out}"
        return
    assert len(lines) <= 1, f"{name} said more than one line: {lines}"
    if damaged:
        assert kind != INPUT, f"{name} (an input) took a damaged file: {out!r:.200}"
        assert len(lines) == 1 and shown in lines[0], f"{name} took a damaged file without a word: {out!r:.200}"
        assert kind == RECORD or out is None, f"{name} (a cache) trusted a damaged file: {out!r:.200}"


def _damages(name: str) -> Iterator[tuple[str, bytes | None, bool]]:
    """(what, the file's bytes or None for no file, must the reader notice) for one reader's format."""
    fmt, sample_of, _ = SAMPLES[name]
    entry, sample = READERS[name], sample_of()
    yield "missing", None, False
    yield "empty", b"", fmt == "json" or name.endswith(("read_architecture", "read_pickle"))
    if entry.max_bytes is not None:
        yield "larger than its limit", b"\0" * (entry.max_bytes + 1), True
    if fmt == "bytes":
        yield "truncated", sample[: len(sample) // 2], name.endswith(("read_architecture", "read_pickle"))
        return
    yield "not UTF-8", sample + b"\n\xff\xfe\xfa\n", True
    yield "UTF-16", sample.decode().encode("utf-16"), True
    if fmt == "text":
        return
    yield "truncated", sample[: len(sample) * 2 // 3].rstrip(b"\n"), fmt == "json"
    deep = b"[" * 100_000 + b"]" * 100_000 if fmt == "json" else b"- " * 5_000 + b"x"
    yield "nested 100,000 deep", deep, True
    huge = b'{"a": 1' + b"0" * 6000 + b"}" if fmt != "yaml" else b"a: 1" + b"0" * 6000
    yield "a 6,000-digit integer", huge, True
    if entry.max_line_bytes is not None:
        yield "a huge line", sample + b'"' + b"x" * entry.max_line_bytes + b'"\n', True
    if isinstance(entry.fields, dict) and set(entry.fields) != {str}:
        good = json.loads(sample.splitlines()[-1] if fmt == "jsonl" else sample)
        for field, spec in entry.fields.items():
            for value in [*JSON_VALUES, float("nan"), float("inf")]:
                if readers.check_fields(value, spec, finite=entry.kind != RECORD)[1]:  # a value that does not fit
                    text = json.dumps({**good, field: value})
                    yield f"{field}={text[:40]}", text.encode() + (b"\n" if fmt == "jsonl" else b""), True
        for field, spec in entry.fields.items():
            if isinstance(spec, Need):
                yield f"no {field}", json.dumps({k: v for k, v in good.items() if k != field}).encode(), True


@pytest.mark.parametrize("name", FED)
def test_each_kind_keeps_its_promise_on_damaged_files(name: str, tmp_path: Path, shared_dir: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    fmt, sample_of, _ = SAMPLES[name]
    path = shared_dir / f"{name.replace(':', '.')}.{fmt}"
    path.write_bytes(sample_of())
    out, lines = _feed(name, path, caplog)
    assert out is not None and not isinstance(out, Exception) and not lines, (name, out, lines)  # a good file reads
    path.chmod(0o000)  # mode 000: the kernel's PermissionError (`as_nobody`)
    _kept(name, path, *_feed(name, path, caplog, nobody=True), damaged=True)
    path.unlink()
    for what, content, damaged in _damages(name):
        if content is not None:
            path.write_bytes(content)
        out, lines = _feed(name, path, caplog)
        try:
            _kept(name, path, out, lines, damaged)
        except AssertionError as err:
            raise AssertionError(f"{what}: {err}") from None
        path.unlink(missing_ok=True)
    for what, make in (("a directory", lambda: path.mkdir()), ("a FIFO", lambda: os.mkfifo(path)),
                       ("a link to /dev/zero", lambda: path.symlink_to("/dev/zero")),
                       ("a symlink loop", lambda: path.symlink_to(path))):
        make()
        try:
            _kept(name, path, *_feed(name, path, caplog), damaged=True)
        except AssertionError as err:
            raise AssertionError(f"{what}: {err}") from None
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()


@pytest.mark.parametrize("name", FED)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300) | st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20).map(lambda v: json.dumps(v).encode()))
def test_random_bytes_and_json_never_break_a_reader(name: str, data: bytes, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / f"{name.replace(':', '.')}.{SAMPLES[name][0]}"
    path.write_bytes(data)
    out, lines = _feed(name, path, caplog)
    _kept(name, path, out, lines, damaged=False)


def test_a_task_yaml_too_deep_to_walk_is_called_that_not_unreadable(tmp_path: Path) -> None:
    """YAML that loads but nests past the readers' depth is refused as too deep, not as "not YAML" (the depth
    check once ran inside the loader's `except ValueError`, and Damaged is a ValueError)."""
    from llmexp.machine.task_code import read_task_yaml

    path = tmp_path / "deep.yaml"
    path.write_text("a: " + "[" * (readers.MAX_DEPTH + 5) + "]" * (readers.MAX_DEPTH + 5) + "\n")
    with pytest.raises(UserError) as err:
        read_task_yaml(path)
    assert f"YAML nested deeper than {readers.MAX_DEPTH} levels" in str(err.value)
    assert "not YAML" not in str(err.value) and str(path) in str(err.value)


# ----------------------------------------------------------------------------- records


def test_a_diverged_runs_nan_and_inf_metrics_are_read_not_skipped(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The logger writes NaN and infinity as strings (JSON has none): a float field reads them back as numbers, so a
    diverged run's report shows the steps that matter. Other strings in a float field are still skipped, and a
    strict reader (a cache) takes no non-finite value at all."""
    import math

    from llmexp.monitor.logger import _json_line
    from llmexp.rundir.read import read_metrics

    losses = [2.5, math.inf, -math.inf, math.nan]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(_json_line({"step": i, "event": "train", "loss": x, "time_s": 0.1})
                            for i, x in enumerate(losses)) + '{"step": 4, "event": "train", "loss": "NaN"}\n')
    readers._said.clear()
    with caplog.at_level(logging.INFO, logger="llmexp.readers"):
        records = read_metrics(path)
    assert [r["loss"] for r in records[:3]] == losses[:3] and math.isnan(records[3]["loss"]) and len(records) == 4
    assert [r.getMessage() for r in caplog.records] == [
        f"llmexp: skipped 1 of 5 lines of {path} (line 5: not a record: loss is a string, not a number or null)"]
    assert readers.check_fields({"x": "inf"}, {"x": float}, finite=True) == ({}, ["x is a string, not a number"])


# ----------------------------------------------------------------------------- caches, never trusted


@pytest.mark.parametrize("suggestion", [1e30, True, "3e-4", -1e-4, float("nan"), None])
def test_a_damaged_lr_find_json_is_a_miss(suggestion: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An lr no range test from lr_find_start to lr_find_end could pick (1e30), `true` (read as 1.0), a string:
    each a miss, said in one line, and the finder runs again (`found_lr` tests afresh on None)."""
    from llmexp.train.lr_find import read_lr_find

    path = tmp_path / "lr_find.json"
    good = {"suggestion": 1e-4, "lr_find_steps": 20, "lr_find_start": 1e-7, "lr_find_end": 1.0}
    path.write_text(json.dumps(good))
    assert read_lr_find(path) == good
    path.write_text(json.dumps({**good, "suggestion": suggestion}))
    readers._said.clear()
    with caplog.at_level(logging.INFO, logger="llmexp.readers"):
        assert read_lr_find(path) is None
    assert len(caplog.records) == 1 and str(path) in caplog.records[0].getMessage() \
        and "the range test runs again" in caplog.records[0].getMessage(), caplog.records


def test_a_cache_entry_replaced_by_a_plain_file_is_rebuilt_and_leaves_no_temp_file(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A GGUF conversion's entry (models/gguf-<key>/) that is now a plain file: a miss, rebuilt in its place."""
    from llmexp.data.cache import get_or_build

    built: list[Path] = []

    def build(tmp: Path) -> dict[str, Any]:
        (tmp / "model.safetensors").write_bytes(b"weights")
        built.append(tmp)
        return {"vocab_size": 300}

    entry, _, hit = get_or_build(tmp_path, "models", "gguf-k", build)
    assert not hit and get_or_build(tmp_path, "models", "gguf-k", build)[2]  # built once, then a hit
    for path in entry.iterdir():
        path.unlink()
    entry.rmdir()
    entry.write_text("not an entry")
    readers._said.clear()
    with caplog.at_level(logging.INFO):
        again, _, hit = get_or_build(tmp_path, "models", "gguf-k", build)
    assert not hit and again == entry and (entry / "model.safetensors").read_bytes() == b"weights" and len(built) == 2
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["gguf-k"]  # no temp file or directory beside it
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and str(entry) in said[0], said


def test_a_cache_entry_whose_meta_json_lost_its_files_record_is_a_miss(tmp_path: Path,
                                                                      capfd: pytest.CaptureFixture[str]) -> None:
    """Without the record a deleted file cannot be told from one never written: the entry is rebuilt, not trusted."""
    from llmexp.data.cache import get_or_build

    def build(tmp: Path) -> dict[str, Any]:
        (tmp / "a.npy").write_bytes(b"array")
        return {"n": 1}

    entry, meta, _ = get_or_build(tmp_path, "things", "k", build)
    del meta["files"]
    (entry / "meta.json").write_text(json.dumps(meta))
    (entry / "a.npy").unlink()
    capfd.readouterr()
    _, again, hit = get_or_build(tmp_path, "things", "k", build)
    assert not hit and "files" in again and (entry / "a.npy").read_bytes() == b"array"
    assert "has no record of its files" in capfd.readouterr().err
