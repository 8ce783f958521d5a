"""Signals acted on by a thread of their own, never by a handler in the main thread.

Python runs a signal handler in the main thread between two bytecodes, wherever that thread is. A
handler that takes a lock deadlocks if the main thread was interrupted while holding it: the
frontend's main loop waits on a threading.Event, and a handler that set the same Event found its
condition's lock already held by the thread it ran in (a frontend that lived on after kill -9 of the
launcher, once in a few loaded CI runs). Here the only thing done at the signal is C's: CPython's
handler writes the signal's number to the wakeup fd, and the watch thread reads it and runs the
action, where taking locks, starting threads and logging are safe. The action runs even while the
main thread is stuck in a C call.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

log = logging.getLogger("tp_runtime.signals")

# `kill -USR1 <pid>` of the launcher, the frontend or a rank writes every thread's Python stack to
# its stderr.
STACK_DUMP_SIGNAL = signal.SIGUSR1


def dump_stacks_on_signal() -> None:
    """The one look inside a stuck process that needs no py-spy: faulthandler writes the stacks from
    C, so a process whose every thread is blocked, or deadlocked holding the GIL, still answers."""
    stream = sys.__stderr__  # the process's own stderr: sys.stderr may be a stream without a file (a test's capture)
    if stream is not None:
        faulthandler.register(STACK_DUMP_SIGNAL, file=stream, all_threads=True)


def _noted(_signum: int, _frame: object) -> None:
    """The Python-level handler: nothing. Installing it is what makes CPython's C handler write the
    signal's number to the wakeup fd (and keeps the default action, often an exit, from running)."""


class SignalWatch:
    """One per process, made in the main thread (signal.set_wakeup_fd must be called there).
    `on(sig, action)` sets, or replaces, what a signal does."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # the C handler must never block
        self._actions: dict[int, Callable[[], None]] = {}
        signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        threading.Thread(target=self._run, name="signals", daemon=True).start()

    def on(self, sig: signal.Signals, action: Callable[[], None]) -> None:
        self._actions[int(sig)] = action
        signal.signal(sig, _noted)

    def _run(self) -> None:
        while True:
            try:
                received = os.read(self._read, 64)
            except InterruptedError:
                continue
            for signum in received:
                action = self._actions.get(signum)
                if action is None:
                    continue
                try:
                    action()
                except Exception:  # one failed action must not end the watch: later signals still count
                    log.exception("the action for signal %d failed", signum)
