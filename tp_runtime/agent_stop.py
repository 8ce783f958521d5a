"""Stopping torchrun's agent from the launcher's other threads.

The agent runs in the launcher's main thread and stops at a signal: SIGINT raises its
SignalException, and it stops the ranks on the way out. The threads that decide a launch must end
(the frontend's watch, the end-of-service watch, the SIGTERM grace timer) send that SIGINT through
here, so that it is sent once and only while the agent runs. Sent after the agent has returned, it
would raise in the launcher's own finishing code; and a launcher that finishes while one of those
threads is still inside a rendezvous-store call dies at interpreter exit: the thread, ended by
pthread_exit as it takes the GIL back, unwinds through a C++ frame that may not throw, and the
process aborts ("terminate called without an active exception", exit -6). So the launcher also
waits for those threads before it leaves.
"""

from __future__ import annotations

import os
import signal
import threading


class AgentStop:
    def __init__(self) -> None:
        # Reentrant: a signal handler that stops the agent may run in the main thread while the
        # main thread is inside returned().
        self._lock = threading.RLock()
        self._running = True
        self.sent = False

    def stop(self) -> bool:
        """SIGINT to this process unless the agent has returned or one was sent; True if sent."""
        with self._lock:
            if not self._running or self.sent:
                return False
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)
            return True

    def returned(self) -> None:
        """The main thread, as the agent returns: no SIGINT from here on. One sent just before
        raises SignalException here, which the caller takes as the agent's own."""
        with self._lock:
            self._running = False

