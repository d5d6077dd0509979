"""tests/warm.py's forked children against fresh processes: the same command sees the same directory, arguments,
environment, module path and standard streams, and ends with the same exit status however it ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests import warm, warm_server

PROBE = r"""
import json, os, random, sys, tempfile
print(json.dumps({"cwd": os.getcwd(), "argv": sys.argv, "path0": sys.path[0], "main": __name__,
                  "var": os.environ.get("LLMEXP_PROBE"), "tmp": tempfile.gettempdir(), "stdin": sys.stdin.read(),
                  "random": random.random()}))
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "raise":
    raise ValueError("boom")
if how == "sleep":
    print("ready", flush=True)
    import time; time.sleep(60)
sys.exit(int(how))
"""


def warm_up(env: dict[str, str], cwd: Path) -> None:
    """A first command in `env`, so that the next one is warm (a server starts on an environment's second)."""
    assert warm.run(["-c", "pass"], [], cwd=cwd, env=env, timeout_s=60).returncode == 0


def both(how: str, tmp_path: Path) -> tuple[tuple, tuple]:
    """(warm, fresh) outcomes of PROBE: (exit code, stdout lines, stderr)."""
    env = {**os.environ, "LLMEXP_PROBE": "x", "TMPDIR": str(tmp_path)}
    outcomes = []
    for fresh in (False, True):
        out, err = tmp_path / f"out-{how}-{fresh}", tmp_path / f"err-{how}-{fresh}"
        proc = warm.popen(["-c", PROBE], [how, "--flag"], cwd=tmp_path, stdout=out, stderr=err,
                          env={**env, "LLMEXP_TEST_FRESH": "1"} if fresh else env)
        assert isinstance(proc, subprocess.Popen if fresh else warm.WarmProcess)
        outcomes.append((proc.wait(timeout=120), out.read_text().splitlines(), err.read_text()))
    return outcomes[0], outcomes[1]


def test_a_warm_child_sees_what_a_fresh_process_sees_and_exits_alike(tmp_path: Path) -> None:
    warm_up({**os.environ, "LLMEXP_PROBE": "x", "TMPDIR": str(tmp_path)}, tmp_path)  # TMPDIR: read on import
    for how in ("0", "3", "raise"):
        warm_run, fresh_run = both(how, tmp_path)
        assert warm_run[0] == fresh_run[0] == {"0": 0, "3": 3, "raise": 1}[how]
        w, f = (json.loads(r[1][0]) for r in (warm_run, fresh_run))
        assert w.pop("random") != f.pop("random")  # reseeded: not the server's sequence
        assert w == f == {"cwd": str(tmp_path), "argv": ["-c", how, "--flag"], "path0": "", "main": "__main__",
                          "var": "x", "tmp": str(tmp_path), "stdin": ""}
        assert warm_run[2].splitlines()[0] == "to stderr" == fresh_run[2].splitlines()[0]
    assert "ValueError: boom" in warm_run[2] and "ValueError: boom" in fresh_run[2]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL, signal.SIGTERM])
def test_a_signal_ends_a_warm_child_as_it_ends_a_fresh_one(signum: int, tmp_path: Path) -> None:
    # After an uncaught KeyboardInterrupt Python ends by SIGINT, unless what it imported changed that (with
    # transformers' Llama imported it exits 1): the fresh process imports what the server preloaded.
    code = (f"import {', '.join(warm_server.PRELOAD)}\n" if signum == signal.SIGINT else "") + PROBE
    codes = []
    warm_up(dict(os.environ), tmp_path)
    for fresh in (False, True):
        env = {**os.environ, **({"LLMEXP_TEST_FRESH": "1"} if fresh else {})}
        out = tmp_path / f"out-{fresh}"
        proc = warm.popen(["-c", code], ["sleep"], cwd=tmp_path, env=env, stdout=out)
        assert isinstance(proc, subprocess.Popen if fresh else warm.WarmProcess)
        deadline = time.monotonic() + 60
        while "ready" not in (out.read_text() if out.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        proc.send_signal(signum)
        codes.append(proc.wait(timeout=60))
    assert codes[0] == codes[1] and (codes[1] == -signum or signum == signal.SIGINT), codes


def test_another_environment_gets_its_own_server_from_its_second_command(tmp_path: Path) -> None:
    """An import-time variable (here PYTHONHASHSEED) differs: a fresh process first, then a server of its own."""
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    first = warm.popen(["-c", "print(hash('x'))"], [], cwd=tmp_path, env=env, stdout=tmp_path / "1")
    second = warm.popen(["-c", "print(hash('x'))"], [], cwd=tmp_path, env=env, stdout=tmp_path / "2")
    assert isinstance(first, subprocess.Popen) and isinstance(second, warm.WarmProcess)
    assert first.wait(timeout=60) == second.wait(timeout=60) == 0
    assert (tmp_path / "1").read_text() == (tmp_path / "2").read_text()  # the seed reached the server
