"""`python -m llmexp ...` for the tests, forked from a warm interpreter (tests/warm_server.py) instead of started
fresh: a fresh process spends ~5 s of CPU importing torch and transformers before it reads its first argument,
about half of the CPU of the suite's ~300 CLI runs (measured on a 2-core Intel Xeon with AMX).

The child is the run a user starts, less that import: the same code from `__main__` on, in the command's own
directory, environment, files and exit code. It is used only where that holds: where the environment differs
from the server's only in llmexp's own variables (`LLMEXP_*`, read when a run reads them, never on import) and
pytest's PYTEST_CURRENT_TEST, and nobody asked for a fresh process (`LLMEXP_TEST_FRESH=1` runs every command
fresh). A command whose environment differs otherwise (PYTHONPATH, HF_HOME, OMP_NUM_THREADS: read on import) gets
a server of its own, up to `MAX_SERVERS` per test worker, then a fresh process. Tests of what happens before
`__main__` (import cost, `--help`'s imports) start their processes themselves."""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

SERVER = Path(__file__).with_name("warm_server.py")
MAX_SERVERS = 2
"""Environments served warm per test worker; each server holds ~0.5 GB."""
READ_WHEN_RUN = ("LLMEXP_", "PYTEST_CURRENT_TEST")
"""The variables a child may change (prefixes): llmexp reads its own when it runs; pytest's names the test."""


class Server:
    """One warm interpreter and the children it forked for this process."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, cwd=SERVER.parent)
        self.started = 0  # requests sent, each one's id its number
        self.changed = threading.Condition()
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int] = {}  # by request id
        self.alive = True
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.changed:
                if "pid" in message:
                    self.pids[message["id"]] = message["pid"]
                else:
                    self.codes[message["id"]] = message["returncode"]
                self.changed.notify_all()
        with self.changed:
            self.alive = False
            self.changed.notify_all()

    def idle(self) -> bool:
        """Whether every child it forked has ended (so it can be stopped)."""
        with self.changed:
            return not self.alive or all(i in self.codes for i in range(self.started))

    def stop(self) -> None:
        """End the server (it exits when its stdin closes); its children have ended."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)

    def start(self, request: dict) -> WarmProcess:
        assert self.proc.stdin is not None
        request["id"], self.started = self.started, self.started + 1
        with self.changed:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            self.changed.wait_for(lambda: request["id"] in self.pids or not self.alive)
            if not self.alive:
                raise RuntimeError("the tests' warm interpreter (tests/warm_server.py) died")
            return WarmProcess(self, request["id"], self.pids.pop(request["id"]))


class WarmProcess:
    """subprocess.Popen's face for a forked child: pid, poll, wait, send_signal, kill, terminate, returncode."""

    def __init__(self, server: Server, request_id: int, pid: int) -> None:
        self.server, self.id, self.pid, self.returncode = server, request_id, pid, None

    def poll(self) -> int | None:
        with self.server.changed:
            self.returncode = self.server.codes.get(self.id, self.returncode)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.server.changed:
            if not self.server.changed.wait_for(lambda: self.id in self.server.codes or not self.server.alive,
                                                timeout):
                raise subprocess.TimeoutExpired(f"warm child {self.pid}", timeout or 0)
        if self.poll() is None:
            raise RuntimeError("the tests' warm interpreter (tests/warm_server.py) died")
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


_servers: dict[frozenset[tuple[str, str]], Server] = {}
"""The warm servers by environment, the most recently used last."""
_uses: collections.Counter[frozenset[tuple[str, str]]] = collections.Counter()


def _server(env: dict[str, str]) -> Server | None:
    """The server for `env`'s import-time variables; None where none may serve. An environment gets one on its
    second command (a server costs what one fresh process does), in place of the least recently used idle one."""
    if "1" in (env.get("LLMEXP_TEST_FRESH"), os.environ.get("LLMEXP_TEST_FRESH")) or os.geteuid() != os.getuid():
        return None  # asked for a fresh process, or a test running as another user (tests/conftest.py's nobody)
    key = frozenset((k, v) for k, v in env.items() if not k.startswith(READ_WHEN_RUN))
    _uses[key] += 1
    if key not in _servers:
        idle = [k for k, server in _servers.items() if server.idle()]
        if _uses[key] < 2 or (len(_servers) >= MAX_SERVERS and not idle):
            return None
        if len(_servers) >= MAX_SERVERS:
            _servers.pop(idle[0]).stop()
        _servers[key] = Server(env)
    server = _servers[key] = _servers.pop(key)  # now the most recently used
    return server if server.alive else None


def popen(entry: Sequence[str], args: Sequence[str], *, cwd: Path | str | None, env: dict[str, str],
          stdout: Path, stderr: Path | None = None) -> WarmProcess | subprocess.Popen:
    """`python ENTRY ARGS` (ENTRY: ["-m", module] or ["-c", code]) with its output in `stdout` (and `stderr`,
    else with stdout): warm where it may be, else a fresh subprocess.Popen."""
    server = _server(env)
    cwd = str(Path(cwd or os.getcwd()).resolve())
    if server is None:
        out = open(stdout, "w")  # noqa: SIM115 (the child holds it; closed here once it is started)
        err = subprocess.STDOUT if stderr is None else open(stderr, "w")  # noqa: SIM115
        try:
            return subprocess.Popen([sys.executable, *entry, *args], stdout=out, stderr=err, env=env, cwd=cwd,
                                    stdin=subprocess.DEVNULL)
        finally:
            out.close()
            if stderr is not None:
                err.close()  # type: ignore[union-attr]
    kind, target = entry
    request = {"module": target} if kind == "-m" else {"code": target}
    return server.start({**request, "args": list(args), "cwd": cwd, "env": env, "stdout": str(stdout),
                         "stderr": str(stderr or stdout)})


def run(entry: Sequence[str], args: Sequence[str], *, cwd: Path | str | None, env: dict[str, str],
        timeout_s: float) -> subprocess.CompletedProcess[str]:
    """subprocess.run(capture_output=True, text=True)'s result for `python ENTRY ARGS`, warm where it may be."""
    folder = Path(tempfile.mkdtemp(prefix="llmexp-warm-"))
    try:
        proc = popen(entry, args, cwd=cwd, env=env, stdout=folder / "stdout", stderr=folder / "stderr")
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess([sys.executable, *entry, *args], proc.returncode,
                                           (folder / "stdout").read_text(), (folder / "stderr").read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
