"""Preemption and Ctrl-C as a flag the trainer checks at each step boundary, never a lost run."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType
from typing import Any, ClassVar

from llmexp.monitor.console import silence_dead_stdio


class PreemptionSignal:
    """While active, SIGTERM, SIGUSR1, SIGUSR2 and SIGINT (Ctrl-C) only set `.requested` (and `.signal_name`), which the
    trainer checks at each step boundary (docs/explanation/checkpoints-and-resume.md); a second SIGINT ends the
    process at once, by SIGINT's default action. Outside the main thread Python cannot install handlers: then it
    stays inert (`.active` is False). Entered while another one is active, it hands out that one, so an early,
    outer guard and the trainer's share one flag."""

    _current: ClassVar[PreemptionSignal | None] = None

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self.active = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        silence_dead_stdio()  # before any write: the stop must not die announcing itself
        if signum == signal.SIGINT and self.signal_name == "SIGINT":  # the second Ctrl-C
            say("\nllmexp: second Ctrl-C: exiting now, without a checkpoint\n")
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
            return
        name = signal.Signals(signum).name
        first = not self.requested
        self.requested = True
        self.signal_name = "SIGINT" if signum == signal.SIGINT else (self.signal_name or name)
        if first:
            again = "; Ctrl-C again exits at once" if signum == signal.SIGINT else ""
            say(f"\nllmexp: {name}: saving a checkpoint at the next step boundary, then stopping{again}\n")

    def __enter__(self) -> PreemptionSignal:
        if PreemptionSignal._current is not None:
            return PreemptionSignal._current
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):  # USR1: `--signal=USR1@N`
            self._previous[sig] = signal.signal(sig, self._handle)
        self.active = True
        PreemptionSignal._current = self
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.active:
            return
        for sig, previous in self._previous.items():
            # None: the old handler was not installed from Python; the default is the best guess.
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        self.active = False
        PreemptionSignal._current = None


def say(text: str) -> None:
    """`text` on stderr with one os.write (print() is not safe inside a signal handler), or nowhere if nobody
    can read it any more."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())
