"""Before Hydra runs (`cli.main.cli` calls `maybe_relaunch` first): a worker of a multi-process launch ends with
its launcher (`watch_launcher`), and `accelerate launch --cpu --num_processes N`, which Accelerate would run as one
process, becomes N torchrun ranks (`relaunch_argv`; this process ends with accelerate: `end_with_parent`)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from llmexp.errors import EXIT_ERROR
from llmexp.monitor.console import silence_dead_stdio
from llmexp.train.preemption import say


def relaunch_argv(parent_cmdline: list[str], env: dict[str, str], argv: list[str]) -> list[str] | None:
    """The torchrun command that runs `argv` on N processes, when this process was started by
    `accelerate launch --cpu --num_processes N` (N > 1) as a single process. Accelerate 1.15 starts CPU
    multi-process jobs only through mpirun (`--mpirun_hostfile`); without it, `--cpu --num_processes 2` silently runs
    ONE process. We start the N ranks with torch.distributed.run instead (gloo), as `--multi_gpu` does on a GPU."""
    if "WORLD_SIZE" in env or env.get("ACCELERATE_USE_CPU", "").lower() not in ("true", "1"):
        return None
    at = next((i for i, a in enumerate(parent_cmdline) if a in ("launch", "accelerate.commands.launch")), None)
    num_processes = None if at is None else _flag_value(parent_cmdline[at + 1:], "--num_processes")
    if num_processes is None or num_processes <= 1:
        return None
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_processes}", *argv]


def _flag_value(args: list[str], flag: str) -> int | None:
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return int(arg.split("=", 1)[1])
        if arg == flag and i + 1 < len(args):
            return int(args[i + 1])
        if not arg.startswith("-"):  # the training script or module: the launcher's flags end here
            return None
    return None


def maybe_relaunch() -> None:
    if "LOCAL_RANK" in os.environ:  # torchrun, accelerate and deepspeed set it in every worker they start
        watch_launcher()
        return
    if "WORLD_SIZE" in os.environ or not os.environ.get("ACCELERATE_USE_CPU"):
        return
    import psutil

    argv = relaunch_argv(psutil.Process(os.getppid()).cmdline(), dict(os.environ), ["-m", "llmexp", *sys.argv[1:]])
    if argv is not None:
        end_with_parent()
        os.execv(sys.executable, argv)


ORPHAN_GRACE_S = 120.0
"""How long a worker whose launcher died may take to checkpoint and stop before it exits regardless (a
collective with a dead peer can block for the process group's timeout, 30 minutes by default)."""


def watch_launcher(poll_s: float = 1.0, grace_s: float = ORPHAN_GRACE_S) -> None:
    """End this worker when the launcher that started it dies (docs/explanation/checkpoints-and-resume.md): a
    daemon thread polls the parent pid and, once it changes, sends SIGTERM (a preemption's stop, with a checkpoint)
    and exits after `grace_s`. Not `prctl(PR_SET_DEATHSIG)`: the kernel sends that when the parent *thread* that
    forked the worker exits, not the process (a launcher may fork from a helper thread), it exists on Linux only,
    and it has no second step for a checkpoint that hangs on a dead peer."""
    parent = os.getppid()
    if parent == 1:  # started by init itself: no launcher to watch
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        silence_dead_stdio()  # the launcher may have been the reader of our stderr
        say(f"llmexp: the launcher (pid {parent}) is gone: stopping this worker (pid {os.getpid()}) "
            "at the next step boundary, with a checkpoint\n")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        say(f"llmexp: worker {os.getpid()} did not stop within {grace_s:.0f} s of its launcher's end; exiting now\n")
        os._exit(EXIT_ERROR)

    threading.Thread(target=watch, name="llmexp-launcher-watch", daemon=True).start()


PR_SET_DEATHSIG = 1
"""prctl(2): the signal this process gets when its parent thread exits."""


def end_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux; elsewhere nothing). Used before
    the relaunch's `execv` into torchrun: after it, no llmexp code runs in this process to watch, and the
    setting survives the exec. Its parent is `accelerate launch`, whose main thread started it and waits for
    it, so the thread's end is the process's. torchrun, on SIGTERM, stops its workers with SIGTERM in turn."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DEATHSIG, int(sig), 0, 0, 0) != 0:
        return  # best effort: the workers still watch their own launcher
    if os.getppid() != parent:  # the parent died before the setting took hold: nobody is left to serve
        os._exit(EXIT_ERROR)
