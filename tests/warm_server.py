"""The tests' warm interpreter (tests/warm.py starts it): it imports what every run imports (torch, transformers'
Llama, accelerate, Hydra, matplotlib and the trainer, ~5 s of CPU), then forks one child per request, which runs
`python -m MODULE ARGS` (or `python -c CODE ARGS`) as a fresh interpreter would: in the request's directory and
environment, with its stdin on /dev/null and its stdout and stderr in the request's files, ended by the
interpreter's own exit (atexit handlers, an uncaught exception's traceback and exit code, Ctrl-C's status).

Protocol, one JSON object a line: requests on stdin ({"id", "module" or "code", "args", "cwd", "env", "stdout",
"stderr"}); on stdout, {"id", "pid"} once a child is forked and {"id", "returncode"} once it has ended. Standard
library only, so that nothing but PRELOAD is imported before a fork."""

from __future__ import annotations

import json
import os
import random
import runpy
import select
import sys
import tempfile
import types

PRELOAD = ("torch", "transformers", "transformers.models.llama.modeling_llama", "accelerate", "hydra", "omegaconf",
           "matplotlib.pyplot", "llmexp.train.train", "llmexp.cli.main")
"""What a default training run imports; anything else a child imports itself, as a fresh process does."""


def send(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def redirect(fd: int, path: str, flags: int) -> None:
    new = os.open(path, flags, 0o644)
    os.dup2(new, fd)
    os.close(new)


def run_child(request: dict) -> None:
    """In the forked child: become the request's process, run it, and exit as its interpreter would (never
    returns: SystemExit or the run's own exception ends the process through the interpreter's shutdown)."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    redirect(0, os.devnull, os.O_RDONLY)
    redirect(1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    if request["stderr"] == request["stdout"]:
        os.dup2(1, 2)
    else:
        redirect(2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    random.seed()  # the server's state would be every child's
    tempfile.tempdir = None  # found again from the child's TMPDIR
    if request.get("code") is not None:
        sys.argv = ["-c", *request["args"]]
        sys.path[0] = ""
        main = sys.modules["__main__"] = types.ModuleType("__main__")  # as `python -c` has it
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = [request["module"], *request["args"]]
        sys.path[0] = os.getcwd()
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


def serve() -> None:
    for name in PRELOAD:
        __import__(name)
    import matplotlib

    matplotlib.use("Agg", force=True)
    pending, children = b"", {}
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            data = os.read(0, 1 << 16)
            if not data:
                return  # the tests' process is gone
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    run_child(request)
                children[pid] = request["id"]
                send({"id": request["id"], "pid": pid})
        reap(children)


def reap(children: dict[int, int]) -> None:
    """Report each child that has ended, by its request's id (a pid may be reused later)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send({"id": children.pop(pid), "returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve()
