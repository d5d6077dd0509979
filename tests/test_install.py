"""The ordinary installs work (issue 15): a wheel (`pip install .`) and a plain `pip install -e .` each
run a `--multirun` from a directory outside the checkout, Hydra finding llmexp's sweeper and launcher (one job:
what a second would add, the launcher's queue, tests/test_launcher_local.py checks).

Each install goes into a throw-away venv that sees the machine's dependencies (torch, hydra...) as a
plain directory on sys.path, not through `--system-site-packages`: that would also run the `.pth`
files of an llmexp already installed there, whose checkout would then answer the imports and the
plugin scan instead of the install under test. The test asserts where llmexp and its launcher came from.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY

QUICK = [*TINY, "train.max_steps=5", "train.eval_steps=5"]


def make_venv(root: Path) -> Path:
    """A venv without pip or setuptools of its own (so the machine's are used) whose sys.path ends with
    the machine's site-packages directories, without processing their .pth files; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    Path(own, "_machine_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def pip(python: Path, *args: str) -> None:
    """`pip install` into the venv: no dependencies, the machine's setuptools builds, and an llmexp the
    machine has already is neither taken as satisfying the request nor uninstalled (--ignore-installed)."""
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--ignore-installed", *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def clean_env() -> dict[str, str]:
    """The test session's environment minus PYTHONPATH, which would put a checkout ahead of the install."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def where_from(python: Path, cwd: Path) -> dict[str, str]:
    """The files llmexp and the launcher class Hydra discovered were imported from, in the venv."""
    code = ("import json, llmexp; from hydra.core.plugins import Plugins; from hydra.plugins.launcher import Launcher\n"
            "found = {c.__name__: __import__('sys').modules[c.__module__].__file__ "
            "for c in Plugins.instance().discover(Launcher)}\n"
            "print(json.dumps({'llmexp': llmexp.__file__, **found}))")
    proc = subprocess.run([str(python), "-c", code], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_sweep(python: Path, cwd: Path) -> Path:
    """`python -m llmexp --multirun lr=1e-4 train.max_steps=5` from `cwd`; returns the sweep dir."""
    sweep = cwd / "sweep"
    proc = subprocess.run([str(python), "-m", "llmexp", "--multirun", "lr=1e-4", *QUICK,
                           f"hydra.sweep.dir={sweep}"], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return sweep


def assert_the_job_completed(sweep: Path) -> None:
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["completed"], jobs
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 5, summary


@pytest.mark.slow
def test_a_wheel_install_runs_a_sweep_outside_the_checkout(tmp_path: Path) -> None:
    wheels, source = tmp_path / "wheels", tmp_path / "source"
    # A copy: setuptools' build/ in the checkout could carry files deleted since into the wheel
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__",
                                                                "outputs", "multirun", ".venv"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(wheels), str(source)], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = wheels.glob("llmexp-*.whl")
    python = make_venv(tmp_path / "venv")
    pip(python, str(wheel))
    work = tmp_path / "elsewhere"
    work.mkdir()
    found = where_from(python, work)
    installed = tmp_path / "venv"
    assert Path(found["llmexp"]).is_relative_to(installed), found  # not the checkout
    assert Path(found["LocalLauncher"]).is_relative_to(installed), found
    assert Path(found["SlurmLauncher"]).is_relative_to(installed), found
    assert_the_job_completed(run_sweep(python, work))


@pytest.mark.slow
def test_a_plain_editable_install_runs_a_sweep_outside_the_checkout(tmp_path: Path) -> None:
    python = make_venv(tmp_path / "venv")
    pip(python, "-e", str(REPO))  # setuptools' default (strict) editable mode, no --config-settings
    work = tmp_path / "elsewhere"
    work.mkdir()
    found = where_from(python, work)
    for name in ("llmexp", "LocalLauncher", "SlurmLauncher"):
        assert Path(found[name]).is_relative_to(REPO), found  # this checkout, through the editable finder
    assert_the_job_completed(run_sweep(python, work))
