"""llmexp.checkpoint.store: atomic saves under injected crashes, rotation, corruption fallback, safe
loading, RNG round trips and preemption signals. Real files, real fsync, real signals; the
only fakes are the injected failures (os.replace / os.fsync raising), which stand in for a
crash or a full disk at that exact call."""

from __future__ import annotations

import functools
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmexp.checkpoint import serialize
from llmexp.checkpoint import store as ck
from llmexp.checkpoint.serialize import (
    CorruptCheckpoint,
    UnsafeState,
    capture_rng,
    load_state,
    load_tensors,
    restore_rng,
    save_state,
    save_tensors,
)
from llmexp.checkpoint.store import (
    list_checkpoints,
    load_with_fallback,
    rotate,
    save_checkpoint,
    verify_checkpoint,
)
from llmexp.errors import UserError
from llmexp.rundir import files as rundir_files
from llmexp.train.preemption import PreemptionSignal

FILES = ("model.safetensors", "optimizer.pt", "sub/rng_rank0.pt", "meta.json")


def find_resume_checkpoint(root: Path, warn: Callable[[str], None]) -> Path | None:
    """The checkpoint a resume picks: `load_with_fallback` with a load that reads nothing."""
    found = load_with_fallback(root, lambda path: None, warn)
    return found[0] if found else None


def _writer(step: int, fail_after: int | None = None):
    """A write callback that writes FILES (tagged with the step) and raises after `fail_after`."""

    def write(tmp: Path) -> None:
        for i, rel in enumerate(FILES):
            if fail_after is not None and i == fail_after:
                raise OSError(28, "No space left on device (injected)")
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if rel.endswith(".safetensors"):
                save_tensors(path, {"w": torch.full((4, 4), float(step))})
            elif rel.endswith(".pt"):
                save_state(path, {"step": step, "t": torch.arange(8) * step})
            else:
                path.write_text(json.dumps({"step": step}))

    return write


@functools.cache
def _dead_pid() -> int:
    """The pid of a process that has exited (pid reuse within a test run is not a concern)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _state(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes: 'intact' means exactly equal."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _steps(root: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in list_checkpoints(root)]


def test_save_writes_manifest_and_leaves_no_tmp(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    path = save_checkpoint(root, 7, _writer(7), keep=2, extra={"best_metric": 1.5})
    assert path == root / "step_7"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["format_version"] == ck.FORMAT_VERSION
    assert sorted(manifest["files"]) == sorted(FILES) and manifest["extra"] == {"best_metric": 1.5}
    for rel, entry in manifest["files"].items():
        assert entry["size"] == (path / rel).stat().st_size and len(entry["sha256"]) == 64
    assert [p.name for p in root.iterdir()] == ["step_7"]
    verify_checkpoint(path)
    assert load_tensors(path / "model.safetensors")["w"].eq(7).all()


@pytest.mark.parametrize("fail_after", range(len(FILES)))
def test_crash_in_write_keeps_previous(tmp_path: Path, fail_after: int) -> None:
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 10, _writer(10), keep=1)
    before = _state(root)
    with pytest.raises(ck.DiskFull, match=r"no space left on device while writing .*step_20 .*injected"):
        save_checkpoint(root, 20, _writer(20, fail_after), keep=1)
    assert _state(root) == before and _steps(root) == [10]
    assert find_resume_checkpoint(root, pytest.fail) == root / "step_10"
    assert [p.name for p in root.iterdir()] == ["step_10"]  # the partial tmp dir is gone


def _count_calls(monkeypatch: pytest.MonkeyPatch, name: str, root: Path, step: int) -> int:
    calls = []
    real = getattr(os, name)
    monkeypatch.setattr(os, name, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    save_checkpoint(root, step, _writer(step), keep=1)
    monkeypatch.setattr(os, name, real)
    return len(calls)


def _fail_at(monkeypatch: pytest.MonkeyPatch, name: str, k: int) -> None:
    real, calls = getattr(os, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == k + 1:
            raise OSError(5, f"I/O error (injected at {name} call {k})")
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, failing)


@pytest.mark.parametrize("name", ["fsync", "replace"])
@pytest.mark.parametrize("replacing", [False, True], ids=["new-step", "replace-step"])
def test_crash_at_each_fsync_or_rename_keeps_a_good_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               name: str, replacing: bool) -> None:
    """Fail the k-th os.fsync / os.replace of a save (keep=1, so rotation deletes too), for every
    k. Either the previous checkpoint is intact and chosen, or the new one was fully published
    (and only then was the old one rotated away) and is chosen."""
    monkeypatch.setattr(rundir_files, "_exchange", lambda a, b: False)  # exercise the portable two-rename path
    new_step = 10 if replacing else 20
    probe = tmp_path / "probe"
    save_checkpoint(probe, 10, _writer(10), keep=1)
    total = _count_calls(monkeypatch, name, probe, new_step)
    assert total >= 2
    for k in range(total):
        root = tmp_path / f"case{k}"
        save_checkpoint(root, 10, _writer(10), keep=1)
        before = _state(root)
        with monkeypatch.context() as m:
            _fail_at(m, name, k)
            with pytest.raises(OSError, match="injected"):
                save_checkpoint(root, new_step, _writer(new_step), keep=1)
        chosen = find_resume_checkpoint(root, pytest.fail)
        assert chosen is not None and chosen == list_checkpoints(root)[-1]
        verify_checkpoint(chosen)
        if chosen.name == "step_10" and not replacing:
            assert _state(root) == before, f"{name} call {k}"
        assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")], f"{name} call {k}: tmp left"


def test_interrupted_replace_is_restored_by_next_run(tmp_path: Path) -> None:
    """A replace cut between its renames (old copy aside, new not in place) by a hard kill: the
    next rotate, seeing the writer's pid dead, puts the old copy back."""
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 5, _writer(5), keep=3)
    save_checkpoint(root, 10, _writer(10), keep=3)
    before = _state(root / "step_10")
    os.replace(root / "step_10", root / f".tmp-old-step_10-{ck._host()}-{_dead_pid()}")
    assert _steps(root) == [5]
    rotate(root, 3, None)
    assert _steps(root) == [5, 10] and _state(root / "step_10") == before


def test_sigkill_during_save_keeps_previous(tmp_path: Path) -> None:
    """A real process killed with SIGKILL in the middle of writing a checkpoint."""
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, _writer(1), keep=1)
    before = _state(root)
    code = f"""
import time
from collections.abc import Callable
from pathlib import Path
from llmexp.checkpoint.store import save_checkpoint
def write(tmp):
    (tmp / "model.safetensors").write_bytes(b"x" * 1000)
    print("writing", flush=True)
    time.sleep(60)
save_checkpoint(Path({str(root)!r}), 2, write, keep=1)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    proc.kill()
    proc.wait()
    assert any(p.name.startswith(".tmp-step_2-") for p in root.iterdir())  # the dead writer's leftover
    assert _state(root).items() >= before.items() and _steps(root) == [1]
    assert find_resume_checkpoint(root, pytest.fail) == root / "step_1"
    save_checkpoint(root, 3, _writer(3), keep=1)  # rotation removes the dead writer's tmp dir
    assert sorted(p.name for p in root.iterdir()) == ["step_3"]


def test_tmp_dirs_of_live_processes_are_never_removed(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    host = ck._host()
    live = root / f".tmp-step_9-{host}-{os.getppid()}"  # our parent is alive
    ours = root / f".tmp-step_8-{host}-{os.getpid()}"
    young_foreign = root / ".tmp-step_7-otherhost-1"
    old_foreign = root / ".tmp-step_6-otherhost-2"
    dead = root / f".tmp-del-step_5-{host}-{_dead_pid()}"
    for d in (live, ours, young_foreign, old_foreign, dead):
        d.mkdir(parents=True)
        (d / "f").write_text("x")
    past = time.time() - ck.FOREIGN_TMP_STALE_S - 60
    os.utime(old_foreign, (past, past))
    rotate(root, 1, None)
    assert live.exists() and ours.exists() and young_foreign.exists()
    assert not old_foreign.exists() and not dead.exists()


def test_foreign_step_dir_is_displaced_not_deleted(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / "step_4").mkdir(parents=True)
    (root / "step_4" / "notes.txt").write_text("mine")
    save_checkpoint(root, 4, _writer(4), keep=1)
    displaced = [p for p in root.iterdir() if p.name.startswith("step_4.displaced-")]
    assert len(displaced) == 1 and (displaced[0] / "notes.txt").read_text() == "mine"
    verify_checkpoint(root / "step_4")


def test_rotation_orders_by_step_and_spares_the_one_just_saved(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (2, 10, 9, 11):
        save_checkpoint(root, step, _writer(step), keep=2)
    assert _steps(root) == [10, 11]
    save_checkpoint(root, 3, _writer(3), keep=2, best_step=10)  # e.g. after a rollback
    assert _steps(root) == [3, 10, 11]
    with pytest.raises(ValueError, match="keep"):
        rotate(root, 0, None)


def _corrupt_truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-7])


def _corrupt_flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(("corrupt", "why"), [(_corrupt_truncate, "truncated"), (_corrupt_flip, "sha256")])
@pytest.mark.parametrize("rel", ["model.safetensors", "sub/rng_rank0.pt"])
def test_fallback_from_corrupted_file_names_it(tmp_path: Path, corrupt, why: str, rel: str) -> None:
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        save_checkpoint(root, step, _writer(step), keep=3)
    corrupt(root / "step_20" / rel)
    warnings: list[str] = []
    assert find_resume_checkpoint(root, warnings.append) == root / "step_10"
    assert len(warnings) == 1 and str(root / "step_20" / rel) in warnings[0] and why in warnings[0]
    with pytest.raises(CorruptCheckpoint, match=rel):
        verify_checkpoint(root / "step_20")
    verify_checkpoint(root / "step_20", full=False) if why == "sha256" else None
    assert _steps(root) == ([10, 20] if why == "sha256" else [10])


def test_no_manifest_or_no_good_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    assert find_resume_checkpoint(root, pytest.fail) is None and list_checkpoints(root) == []
    save_checkpoint(root, 1, _writer(1), keep=2)
    (root / "step_1" / "manifest.json").unlink()
    warnings: list[str] = []
    assert find_resume_checkpoint(root, warnings.append) is None
    assert "manifest.json: missing" in warnings[0]


def test_each_fallback_warning_says_what_follows(tmp_path: Path) -> None:
    """An unusable checkpoint's warning names the older one tried next, or says that none is left and what the
    caller does then (a resume starts from scratch). (Before: "falling back to an older one" when there was none.)"""
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(root, step, _writer(step), keep=3)
    for step in (1, 2):
        _corrupt_flip(root / f"step_{step}" / "model.safetensors")
    warnings: list[str] = []
    assert find_resume_checkpoint(root, warnings.append) is None
    assert [w.split(": ")[0] for w in warnings] == [
        "checkpoint step_2 is unusable, falling back to step_1",
        "checkpoint step_1 is unusable, and no older one is left, so the run starts from scratch"], warnings
    assert str(root / "step_1" / "model.safetensors") in warnings[1]
    warnings.clear()
    assert load_with_fallback(root, lambda path: None, warnings.append, none_left="there is nothing to roll "
                              "back to") is None
    assert warnings[1].startswith("checkpoint step_1 is unusable, and no older one is left, so there is nothing to "
                                  "roll back to: "), warnings


def test_unlisted_or_foreign_format_is_not_complete(tmp_path: Path) -> None:
    """A file planted after the save (e.g. an optional scaler.pt a loader would pick up), or a
    manifest of another format version, makes the checkpoint unusable, naming the file."""
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(root, step, _writer(step), keep=3)
    save_state(root / "step_2" / "scaler.pt", {"scale": 1.0})
    warnings: list[str] = []
    assert find_resume_checkpoint(root, warnings.append) == root / "step_1"
    assert "step_2/scaler.pt: not listed in the manifest" in warnings[0]
    manifest = json.loads((root / "step_1" / "manifest.json").read_text())
    (root / "step_1" / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(CorruptCheckpoint, match="format_version 99"):
        verify_checkpoint(root / "step_1")
    assert list_checkpoints(root) == []
    assert issubclass(CorruptCheckpoint, UserError)  # an explicit train.resume=<bad path> exits 2


def test_manifest_cannot_point_outside(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    path = save_checkpoint(root, 1, _writer(1), keep=2)
    (tmp_path / "secret").write_text("s")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["../../secret"] = {"size": 1, "sha256": "0" * 64}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpoint, match="outside"):
        verify_checkpoint(path)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


@pytest.mark.parametrize("fmt", ["torch_zip", "raw_pickle"])
def test_malicious_pickle_never_runs(tmp_path: Path, fmt: str) -> None:
    """A checkpoint file whose unpickling would write a marker file: the loader refuses it, the
    marker never appears, and resume falls back to the previous checkpoint naming the file."""
    root, marker = tmp_path / "checkpoints", tmp_path / "marker"
    save_checkpoint(root, 10, _writer(10), keep=3)

    def write_evil(tmp: Path) -> None:
        _writer(20)(tmp)
        payload = {"step": 20, "x": _Evil(marker)}
        if fmt == "torch_zip":
            torch.save(payload, tmp / "optimizer.pt")
        else:
            (tmp / "optimizer.pt").write_bytes(pickle.dumps(payload, protocol=2))

    save_checkpoint(root, 20, write_evil, keep=3)  # the manifest hashes match: only loading can tell
    with pytest.raises(CorruptCheckpoint, match=r"optimizer\.pt"):
        load_state(root / "step_20" / "optimizer.pt")
    warnings: list[str] = []
    path, state = load_with_fallback(root, lambda p: load_state(p / "optimizer.pt"), warnings.append)
    assert path == root / "step_10" and state["step"] == 10
    assert len(warnings) == 1 and "step_20/optimizer.pt" in warnings[0]
    assert not marker.exists()


def test_save_state_refuses_what_cannot_be_loaded_safely(tmp_path: Path) -> None:
    with pytest.raises(UnsafeState, match=r"\['history'\]\[1\].*numpy.float64"):
        save_state(tmp_path / "s.pt", {"history": [1.0, np.float64(2.0)]})
    assert not (tmp_path / "s.pt").exists()
    state = {"a": [1, 2.5, None, "x", (True, b"y")], "t": torch.ones(2, dtype=torch.float16), "d": torch.bfloat16}
    save_state(tmp_path / "ok.pt", state)
    loaded = load_state(tmp_path / "ok.pt")
    assert loaded["a"] == state["a"] and loaded["t"].dtype == torch.float16 and loaded["d"] == torch.bfloat16


def test_save_tensors_round_trip_with_tied_weights(tmp_path: Path) -> None:
    emb = torch.randn(16, 8)
    tensors = {"embed": emb, "lm_head": emb, "t": torch.randn(8, 4).t(), "h": torch.randn(3).half()}
    save_tensors(tmp_path / "m.safetensors", tensors)
    loaded = load_tensors(tmp_path / "m.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype
    _corrupt_truncate(tmp_path / "m.safetensors")
    with pytest.raises(CorruptCheckpoint, match=r"m\.safetensors"):
        load_tensors(tmp_path / "m.safetensors")


def _draw() -> tuple:
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3).tolist(),
            torch.randint(0, 1000, (4,)).tolist())


def test_rng_round_trip_through_a_safe_file(tmp_path: Path) -> None:
    random.gauss(0, 1)  # leave a cached gaussian in both python and numpy
    np.random.randn()
    save_state(tmp_path / "rng.pt", capture_rng())
    expected = _draw()
    assert _draw() != expected  # the generators moved on
    restore_rng(load_state(tmp_path / "rng.pt"))
    assert _draw() == expected
    assert serialize.rng_filename(3) == "rng_rank3.pt"


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT])
def test_preemption_signal_sets_flag_and_restores_handler(signum: int) -> None:
    seen: list[int] = []
    previous = signal.signal(signum, lambda s, f: seen.append(s))
    try:
        with PreemptionSignal() as preempt:
            assert preempt.active and not preempt.requested
            os.kill(os.getpid(), signum)
            for _ in range(100):  # the handler runs at the next bytecode boundary
                if preempt.requested:
                    break
                time.sleep(0.01)
            assert preempt.requested and preempt.signal_name == signal.Signals(signum).name
        assert seen == []  # the previous handler did not fire while we held the signal
        os.kill(os.getpid(), signum)
        time.sleep(0.05)
        assert seen == [signum]  # and it is back afterwards
    finally:
        signal.signal(signum, previous)


# ----------------------------------------------------------------------------- rotation property

_OPS = st.lists(st.one_of(
    st.tuples(st.just("save"), st.integers(0, 3)),          # next step = last + delta (0: re-save)
    st.tuples(st.just("crash_save"), st.integers(1, 3)),    # a save whose write raises
    st.tuples(st.just("best"), st.integers(0, 40)),         # declare a step the best
    st.tuples(st.just("stale_tmp"), st.integers(0, 40)),    # a dead writer's leftover
    st.tuples(st.just("live_tmp"), st.integers(0, 40)),     # a live writer's tmp dir
    st.tuples(st.just("foreign"), st.sampled_from(["step_x", "notes", "step_900", "step_12.bak", ".cache"])),
), max_size=25)


def _tiny_writer(step: int, fail: bool = False):
    def write(tmp: Path) -> None:
        (tmp / "a.bin").write_bytes(step.to_bytes(4, "little"))
        if fail:
            raise RuntimeError("injected")
        (tmp / "b.json").write_text("{}")

    return write


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keep=st.integers(1, 4), ops=_OPS)
def test_rotation_property(tmp_path_factory: pytest.TempPathFactory, keep: int, ops: list) -> None:
    """Random histories of saves, failed saves, bests, stale/live tmp dirs and foreign dirs.
    The checkpoints left are exactly the `keep` newest plus the best (when it was saved); so
    never the newest or best deleted, never more than keep+1; foreign and live dirs untouched;
    dead writers' tmp dirs gone after the next save."""
    root = tmp_path_factory.mktemp("rot") / "checkpoints"
    root.mkdir()
    host, dead = ck._host(), _dead_pid()
    expected: set[int] = set()
    protected: dict[Path, bytes] = {}
    step, best, stale = -1, None, []
    for op, arg in ops:
        if op == "save":
            step = max(step, 0) + arg
            save_checkpoint(root, step, _tiny_writer(step), keep=keep, best_step=best)
            expected.add(step)
            newest = sorted(expected)[-keep:]
            expected = {s for s in expected if s in newest or s == best}
            stale = []
        elif op == "crash_save":
            with pytest.raises(RuntimeError):
                save_checkpoint(root, max(step, 0) + arg, _tiny_writer(0, fail=True), keep=keep, best_step=best)
        elif op == "best":
            best = arg
        elif op in ("stale_tmp", "live_tmp"):
            d = root / f".tmp-step_{arg}-{host}-{dead if op == 'stale_tmp' else os.getppid()}"
            d.mkdir(exist_ok=True)
            (d / "partial").write_bytes(b"p")
            if op == "stale_tmp":
                stale.append(d)
            else:
                protected[d / "partial"] = b"p"
        else:
            (root / arg).mkdir(exist_ok=True)
            protected[root / arg / "mine"] = arg.encode()
            (root / arg / "mine").write_bytes(arg.encode())
        assert set(_steps(root)) == expected
        assert len(expected) <= keep + 1
        assert all(p.read_bytes() == data for p, data in protected.items())
        assert all(d.exists() for d in stale)  # only a save (rotation) removes them...
        if op == "save":
            assert not any(p.name.startswith(".tmp-") and p.name.endswith(f"-{dead}") for p in root.iterdir())


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_publish_dir_replaces_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  exchange: bool) -> None:
    if not exchange:
        monkeypatch.setattr(rundir_files, "_exchange", lambda a, b: False)
    final = tmp_path / "model"
    for version in ("v1", "v2"):
        tmp = tmp_path / f".model.{version}"
        tmp.mkdir()
        (tmp / "weights").write_text(version)
        rundir_files.publish_dir(tmp, final)
        assert (final / "weights").read_text() == version and not tmp.exists()
    tmp = tmp_path / ".model.v3"
    tmp.mkdir()
    (tmp / "weights").write_text("v3")
    with monkeypatch.context() as m:
        _fail_at(m, "replace", 0 if exchange else 1)  # renameat2 needs no os.replace: fail the fallback
        m.setattr(rundir_files, "_exchange", lambda a, b: False)
        with pytest.raises(OSError, match="injected"):
            rundir_files.publish_dir(tmp, final)
    assert (final / "weights").read_text() == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.v3", "model"]


# ----------------------------------------------------------------------------- links, displaced copies, full disks


def _outside_checkpoint(tmp_path: Path, step: int) -> tuple[Path, dict[str, bytes]]:
    """A complete checkpoint of `step` outside the checkpoints dir (what a step_N link points at)."""
    elsewhere = tmp_path / "elsewhere"
    save_checkpoint(elsewhere, step, _writer(step), keep=5)
    return elsewhere / f"step_{step}", _state(elsewhere)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_symlinked_step_dir_is_moved_aside_never_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         exchange: bool) -> None:
    """`step_4` replaced by a link to a (complete) checkpoint elsewhere: saving step 4 again moves
    the link aside and writes a real step_4; the link's target is untouched. (Before: the swapped-
    out link went to shutil.rmtree, which raised "Cannot call rmtree on a symbolic link".)"""
    if not exchange:
        monkeypatch.setattr(rundir_files, "_exchange", lambda a, b: False)
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 2, _writer(2), keep=3)
    target, outside = _outside_checkpoint(tmp_path, 4)
    (root / "step_4").symlink_to(target, target_is_directory=True)
    save_checkpoint(root, 4, _writer(4), keep=3)
    verify_checkpoint(root / "step_4")
    assert not (root / "step_4").is_symlink()
    aside = [p for p in root.iterdir() if p.name.startswith("step_4.displaced-")]
    assert len(aside) == 1 and aside[0].is_symlink() and aside[0].resolve() == target.resolve()
    assert _state(tmp_path / "elsewhere") == outside
    (root / "step_9").symlink_to(target, target_is_directory=True)  # resume ignores a link, and says so
    warnings: list[str] = []
    assert find_resume_checkpoint(root, warnings.append) == root / "step_4"
    assert len(warnings) == 1 and "step_9 is a symbolic link" in warnings[0]


def test_rotation_never_deletes_through_a_link(tmp_path: Path) -> None:
    """Links named like checkpoints (step_1, and a displaced-looking one) are neither counted nor
    deleted by rotation, and what they point at survives any number of saves."""
    root = tmp_path / "checkpoints"
    target, outside = _outside_checkpoint(tmp_path, 1)
    root.mkdir()
    (root / "step_1").symlink_to(target, target_is_directory=True)
    (root / "step_1.displaced-1").symlink_to(target, target_is_directory=True)
    for step in (2, 3, 4, 5):
        save_checkpoint(root, step, _writer(step), keep=1)
    assert _steps(root) == [5]
    assert (root / "step_1").is_symlink() and (root / "step_1.displaced-1").is_symlink()
    assert _state(tmp_path / "elsewhere") == outside


def test_displaced_copies_follow_the_retention_rule(tmp_path: Path) -> None:
    """A damaged step_N is moved aside when N is saved again; the displaced copy then goes when
    step N leaves the `keep` newest (unless N is the best). Displaced dirs that llmexp did not
    write (no manifest of ours) are never deleted. (Before: displaced copies piled up forever.)"""
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(root, step, _writer(step), keep=5)
        _corrupt_truncate(root / f"step_{step}" / "model.safetensors")  # incomplete: moved aside by the next save
    (root / "step_0.displaced-7").mkdir()
    (root / "step_0.displaced-7" / "notes.txt").write_text("mine")
    for step in (1, 2, 3):
        save_checkpoint(root, step, _writer(step), keep=2, best_step=1)
    displaced = sorted(p.name.split(".")[0] for p in root.iterdir() if ".displaced-" in p.name)
    assert displaced == ["step_0", "step_1", "step_2"]  # 1 is the best, 2 among the 2 newest
    save_checkpoint(root, 4, _writer(4), keep=2, best_step=1)
    displaced = sorted(p.name.split(".")[0] for p in root.iterdir() if ".displaced-" in p.name)
    assert displaced == ["step_0", "step_1"] and _steps(root) == [1, 3, 4]
    assert (root / "step_0.displaced-7" / "notes.txt").read_text() == "mine"
    save_checkpoint(root, 5, _writer(5), keep=2, best_step=None)
    displaced = sorted(p.name.split(".")[0] for p in root.iterdir() if ".displaced-" in p.name)
    assert displaced == ["step_0"] and _steps(root) == [4, 5]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_full_disk_names_the_path_and_keeps_the_older_checkpoints(small_fs: Path) -> None:
    """Saves of ~0.9 MiB checkpoints on a real 3 MiB filesystem until it is full: the failing save
    raises DiskFull naming its path (torch's writer reports ENOSPC as "unexpected pos"), removes its
    partial write, and every older checkpoint still verifies."""
    root = small_fs / "checkpoints"

    def write(step: int):
        def fill(tmp: Path) -> None:
            save_tensors(tmp / "model.safetensors", {"w": torch.full((256, 256), float(step))})
            save_state(tmp / "optimizer.pt", {"m": torch.full((256, 512), float(step))})
        return fill

    saved = []
    with pytest.raises(ck.DiskFull) as info:
        for step in range(1, 10):
            save_checkpoint(root, step, write(step), keep=10)
            saved.append(step)
    assert saved and f"no space left on device while writing {root / f'step_{saved[-1] + 1}'}" in str(info.value)
    assert _steps(root) == saved
    for path in list_checkpoints(root):
        verify_checkpoint(path)
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_second_sigint_exits_at_once() -> None:
    """Ctrl-C sets the flag (and says so); a second one ends the process by SIGINT right away.
    Real signals, in a child process, since the second one ends it."""
    code = """
import signal, time
from llmexp.train.preemption import PreemptionSignal
with PreemptionSignal() as outer, PreemptionSignal() as inner:
    assert inner is outer  # an inner guard shares the outer one's flag
    signal.raise_signal(signal.SIGINT)
    assert outer.requested and outer.signal_name == "SIGINT"
    print("first handled", flush=True)
    signal.raise_signal(signal.SIGINT)
    time.sleep(5)
print("not reached", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGINT, done.stderr
    assert done.stdout == "first handled\n"
    assert "Ctrl-C again exits at once" in done.stderr and "second Ctrl-C: exiting now" in done.stderr


def test_a_stop_survives_the_death_of_whoever_read_stderr(tmp_path: Path) -> None:
    """`accelerate launch` (>= 1.16) tees its child's stderr through a pipe; a kill -9 of it leaves the workers
    writing into a pipe without a reader, and their SIGTERM (from torchrun) then raised BrokenPipeError while
    announcing the stop: no checkpoint, no summary. Here the reader of a real pipe is closed, then SIGTERM: the
    flag is set, later prints (the console's lines) do not raise, and stderr now leads to /dev/null."""
    code = f"""
import os, signal, sys, time
from llmexp.train.preemption import PreemptionSignal
with PreemptionSignal() as stop:
    open({str(tmp_path / "ready")!r}, "w").close()
    while not stop.requested:
        time.sleep(0.01)
    print("a console line after the stop", file=sys.stderr, flush=True)
    with open({str(tmp_path / "done")!r}, "w") as f:
        f.write(stop.signal_name + " " + os.readlink("/proc/self/fd/2"))
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    for _ in range(3000):
        if (tmp_path / "ready").exists() or proc.poll() is not None:
            break
        time.sleep(0.01)
    proc.stderr.close()  # the launcher that read it is gone
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "done").read_text() == f"SIGTERM {os.devnull}"


def test_the_console_survives_the_death_of_whoever_read_it(tmp_path: Path) -> None:
    """The same pipe without a reader before any signal: a worker's next console line (after a kill -9 of
    `accelerate launch`, before torchrun's SIGTERM arrives) raised BrokenPipeError and ended the run with no
    checkpoint and no summary (it failed so under load). The line still reaches llmexp.log; stderr leads to
    /dev/null from then on."""
    code = f"""
import os, sys, time
from pathlib import Path
from llmexp.monitor.logger import MetricsLogger
run = Path({str(tmp_path / "run")!r})
run.mkdir()
console = MetricsLogger(run, max_steps=3, enabled=True)
open({str(tmp_path / "ready")!r}, "w").close()
while not os.path.exists({str(tmp_path / "closed")!r}):
    time.sleep(0.01)
console.write("step 1 | after the reader died")
console.write("step 2 | and again")
with open({str(tmp_path / "done")!r}, "w") as f:
    f.write(os.readlink("/proc/self/fd/2"))
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE,
                            env={**os.environ, "LLMEXP_NO_BAR": "1"})
    for _ in range(3000):
        if (tmp_path / "ready").exists() or proc.poll() is not None:
            break
        time.sleep(0.01)
    proc.stderr.close()  # the launcher that read it is gone
    (tmp_path / "closed").touch()
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "done").read_text() == os.devnull
    log = (tmp_path / "run" / "llmexp.log").read_text()
    assert "step 1 | after the reader died" in log and "step 2 | and again" in log


def test_checkpoints_dir_itself_may_be_a_link(tmp_path: Path) -> None:
    """`checkpoints/` as a link to another disk (a scratch volume, say): saves, rotation and resume
    work inside its target, and the link itself stays a link."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    root = tmp_path / "run" / "checkpoints"
    root.parent.mkdir()
    root.symlink_to(scratch, target_is_directory=True)
    for step in (1, 2, 3):
        save_checkpoint(root, step, _writer(step), keep=2)
    assert root.is_symlink() and sorted(p.name for p in scratch.iterdir()) == ["step_2", "step_3"]
    assert find_resume_checkpoint(root, pytest.fail) == root / "step_3"
