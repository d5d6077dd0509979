"""The CLI's entry phase: a bad invocation leaves no directory at all, a run directory is locked while a run
uses it, and `--help` / `--cfg job` compose the config once without importing torch.

Every case runs the real CLI (`python -m llmexp ...`) in a subprocess, in a fresh working directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmexp.process import GC_THRESHOLDS
from tests.test_bad_input import CASES, REPO, run_llmexp

_WRITES_NOTHING = [c for c in CASES if c[0] != "bf16_unsupported"]  # (bf16 now runs emulated: not a mistake)


@pytest.mark.parametrize(("args", "env"), [c[1:3] for c in _WRITES_NOTHING], ids=[c[0] for c in _WRITES_NOTHING])
def test_a_bad_invocation_exits_2_and_creates_no_directory(args: list[str], env: dict[str, str],
                                                           tmp_path: Path) -> None:
    """With the default run and sweep directories (`outputs/...`, `multirun/...` in the working directory):
    every check runs before Hydra creates anything."""
    proc = run_llmexp(args, tmp_path, env)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr}"
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "cache")
    assert left == [], f"{left} created by a refused invocation:\n{proc.stderr}"


def _hold_lock(run_dir: Path) -> subprocess.Popen[str]:
    """A second, real process that holds `run_dir`'s lock (as a running `python -m llmexp` does) until killed."""
    code = ("import sys, time\nfrom llmexp.rundir.lock import lock_run_dir\nlock_run_dir(sys.argv[1])\n"
            "print('locked', flush=True)\ntime.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_run_on_a_locked_run_dir_exits_2_naming_the_holder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    holder = _hold_lock(run_dir)
    try:
        proc = run_llmexp(["train.max_steps=1", f"hydra.run.dir={run_dir}"], tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert f"is in use by another llmexp run (pid {holder.pid})" in proc.stderr
        assert sorted(p.name for p in run_dir.iterdir()) == [".llmexp.lock"]  # nothing of the second run
    finally:
        holder.kill()
        holder.wait()
    again = _hold_lock(run_dir)  # the kernel dropped the killed holder's lock: the directory is free again
    again.kill()
    again.wait()


@pytest.mark.slow
def test_two_real_runs_on_one_run_dir(tmp_path: Path) -> None:
    """Two `python -m llmexp` runs with different lrs on one directory: the second exits 2 naming the first's
    pid and the first completes with its own settings only (before, both exited 0 and mixed their files)."""
    from tests.conftest import TINY

    run_dir = tmp_path / "run"
    env = {**os.environ, "LLMEXP_CACHE": os.environ.get("LLMEXP_CACHE", str(tmp_path / "cache")),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    first = subprocess.Popen([sys.executable, "-m", "llmexp", *TINY, "train.max_steps=40", "lr=1e-3",
                              f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        while not (run_dir / ".hydra").exists():  # the first run holds the lock from before .hydra/ is written
            assert first.poll() is None, first.communicate()[1]
            time.sleep(0.1)
        second = subprocess.run([sys.executable, "-m", "llmexp", *TINY, "train.max_steps=40", "lr=2e-3",
                                 f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=300)
        assert second.returncode == 2, second.stderr
        assert f"(pid {first.pid})" in second.stderr
    finally:
        _, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr[-3000:]
    assert "lr=2e-3" not in (run_dir / ".hydra" / "overrides.yaml").read_text()


_COUNT_COMPOSITIONS = """
import sys
from hydra._internal.config_loader_impl import ConfigLoaderImpl
calls = []
original = ConfigLoaderImpl.load_configuration
def counted(self, *args, **kwargs):
    calls.append(1)
    return original(self, *args, **kwargs)
ConfigLoaderImpl.load_configuration = counted
from llmexp.cli.main import cli
sys.argv = ["llmexp", *sys.argv[1:]]
code = 0
try:
    cli()
except SystemExit as exit_:
    code = exit_.code
heavy = sorted(m for m in ("torch", "transformers", "accelerate", "numpy") if m in sys.modules)
print("EXIT", code, "COMPOSED", len(calls), "HEAVY", ",".join(heavy) or "none", file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["--help"], ["--cfg", "job"], ["--cfg", "hydra"], ["--help", "optimizer=lion"]])
def test_help_and_cfg_compose_once_and_import_no_torch(args: list[str], tmp_path: Path) -> None:
    proc = run_llmexp(args, tmp_path, code=_COUNT_COMPOSITIONS)
    assert "EXIT 0 COMPOSED 1 HEAVY none" in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_version_is_printed_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from llmexp.cli.main import cli

    monkeypatch.setattr(sys, "argv", ["llmexp", "--version"])
    with pytest.raises(SystemExit) as exit_info:
        cli()
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.count("Hydra ") == 1, out  # the typo check's parse printed it too


@pytest.mark.parametrize(("words", "code", "shown"), [
    (["install=bash"], 0, "hydra_bash_completion"),  # its words are Hydra's subcommand, not overrides to check
    ([], 2, "--shell-completion needs what to do: install=bash"),  # (Hydra's own ValueError traceback)
])
def test_shell_completion_takes_its_subcommand(words: list[str], code: int, shown: str,
                                               monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                               ) -> None:
    from llmexp.cli.main import cli

    monkeypatch.setattr(sys, "argv", ["llmexp", "--shell-completion", *words])
    try:
        cli()
        exit_code = 0  # (as `main` ends the process)
    except SystemExit as exit_:
        exit_code = exit_.code
    out = capsys.readouterr()
    assert exit_code == code and shown in out.out + out.err and "Traceback" not in out.err, out


_GC_AT_EXIT = """
import atexit, gc, runpy, sys
atexit.register(lambda: print("FROZEN", gc.get_freeze_count() > 0, "THRESHOLD", gc.get_threshold()[0],
                              file=sys.stderr))  # runs after the module's end
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
if module == "in-process":
    from llmexp.cli.main import cli
    cli()
runpy.run_module(module, run_name="__main__", alter_sys=True)  # as -m runs it
"""
_TUNED = GC_THRESHOLDS[0]
_DEFAULT = 700  # CPython's


@pytest.mark.parametrize(("module", "args", "frozen", "threshold"), [
    ("llmexp", ["--help"], True, _TUNED),  # python -m llmexp (and the llmexp script: the same main)
    ("llmexp.lr_find", ["--help"], True, _TUNED),
    ("llmexp.estimate", ["--help"], True, _TUNED),
    ("llmexp.coord_check", ["--help"], True, _TUNED),
    ("llmexp.fit", ["--help"], True, _TUNED),
    ("llmexp.sweep.local", ["/nonexistent.pkl", "/nonexistent.json"], True, _TUNED),  # a sweep's fresh job
    ("in-process", ["--help"], False, _DEFAULT),  # `cli` called by a test: its process goes on as it was
])
def test_a_process_entry_tunes_the_collector_and_freezes_its_objects_before_the_interpreter_ends(
        module: str, args: list[str], frozen: bool, threshold: int, tmp_path: Path) -> None:
    """At exit CPython runs full garbage collections over every object the process holds: over a second of CPU at
    the end of a run with torch and transformers loaded, and their imports ran a collection every 700 new objects
    (benchmarks/exit_cpu.py measures both). Each process entry raises the thresholds and freezes the objects
    before the exit; `cli` in someone else's process does neither."""
    proc = run_llmexp([module, *args], tmp_path, code=_GC_AT_EXIT)
    assert f"FROZEN {frozen} THRESHOLD {threshold}" in proc.stderr, proc.stderr[-2000:]


def test_a_run_composes_its_config_once(tmp_path: Path) -> None:
    """Checked, validated and locked on one composition before `@hydra.main` composes it again (refused here by
    a validation error found after composing, so that Hydra never starts)."""
    proc = run_llmexp(["train.eval_steps=0", f"hydra.run.dir={tmp_path / 'run'}"],
                      tmp_path, code=_COUNT_COMPOSITIONS)
    assert "EXIT 2 COMPOSED 1 HEAVY none" in proc.stderr, proc.stderr[-2000:]


def test_a_sweep_job_locks_its_directory_and_a_held_one_fails_that_job(tmp_path: Path) -> None:
    """Sweep jobs run the same check and take the same lock in their own process: a job whose directory is
    held fails with the holder's pid in its record, and the sweep exits 1 (a failed job, not a user error)."""
    sweep = tmp_path / "sweep"
    holder = _hold_lock(sweep / "0")
    try:
        proc = run_llmexp(["--multirun", "train.max_steps=1", "lr=1e-3", f"hydra.sweep.dir={sweep}"], tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 1, proc.stderr[-3000:]
    record = (sweep / "0" / "job_status.json").read_text()
    assert f"is in use by another llmexp run (pid {holder.pid})" in record
    assert json.loads(record)["exit_code"] == 1  # busy, not mistaken: neither the grid nor a search stops on it
    assert not (sweep / "0" / "metrics.jsonl").exists()


def test_a_forked_child_does_not_keep_a_killed_runs_lock(tmp_path: Path) -> None:
    """A run's forked workers (tokenization) share its lock's file; after `kill -9` of the run the lock must be
    free at once, even while such a worker lives on (filelock 4 does not leave its descriptor to a fork)."""
    run_dir = tmp_path / "run"
    code = ("import os, sys, time\nfrom llmexp.rundir.lock import lock_run_dir\nlock_run_dir(sys.argv[1])\n"
            "if os.fork() == 0:\n    time.sleep(60)\n    os._exit(0)\nprint('locked', flush=True)\ntime.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        holder.kill()
        holder.wait()
        again = _hold_lock(run_dir)  # the forked child is still sleeping, yet the lock is free
        again.kill()
        again.wait()
    finally:
        os.killpg(holder.pid, 9)  # the orphaned child too


def test_help_lists_every_group_and_its_options(tmp_path: Path) -> None:
    """`--help` lists groups from the config sources directly (`cli.compose.help_text`): Hydra's listing."""
    proc = run_llmexp(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    for line in ("optimizer: adamw, adamw8bit, lion, lion8bit, paged_adamw8bit, sgd", "cluster: local, slurm",
                 "precision: auto, bf16, fp16, fp32", "scheduler: constant, cosine, linear, wsd"):
        assert line in proc.stdout, proc.stdout[:2000]
    assert "hydra/launcher" not in proc.stdout.split("== Config ==")[0]  # Hydra's own groups stay in --hydra-help


def test_help_and_the_commands_page_name_every_entry_point(tmp_path: Path) -> None:
    """Each `python -m llmexp.X` module (a top-level module or package with a `__main__`) is named in `--help`'s
    header and in docs/reference/commands.md's synopsis, so a new command is found where users look."""
    package = REPO / "llmexp"
    modules = {p.stem for p in package.glob("*.py") if 'if __name__ == "__main__"' in p.read_text()} - {"__main__"}
    entries = sorted(modules | {p.parent.name for p in package.glob("*/__main__.py")})
    assert {"coord_check", "fit", "report", "status"} <= set(entries), entries
    proc = run_llmexp(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.split("== Configuration groups ==")[0]
    synopsis = (REPO / "docs" / "reference" / "commands.md").read_text().split("```")[1]
    for name in entries:
        assert f"llmexp.{name} " in header, f"--help's header (llmexp/conf/config.yaml) does not name llmexp.{name}"
        assert f"python -m llmexp.{name} " in synopsis, f"docs/reference/commands.md does not name llmexp.{name}"


def test_help_shows_each_keys_doc_and_rule_beside_it(tmp_path: Path) -> None:
    """`--help`'s Config section comments every key with the doc and the rule its schema field carries (the text
    `keys.reference()` gives the docs), so a key and what it takes are read in one place."""
    from llmexp.config.keys import reference

    proc = run_llmexp(["--help", "eval=generate", "eval.generate.qa.file=qa.jsonl"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    config = proc.stdout.split("== Config ==")[1]
    comments = " ".join(line.strip().removeprefix("# ") for line in config.splitlines() if line.strip()[:1] == "#")
    assert "  # Width of the residual stream. [must be >= 1]\n  hidden_size: 256\n" in config
    for doc in reference():
        if not doc.key.startswith(("hydra.", "eval.perplexity.", "eval.multiple_choice.")):  # (not in this config)
            assert " ".join(f"{doc.doc} [{doc.rule}]".split()) in comments, doc.key
