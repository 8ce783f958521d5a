"""The frontend's side of a supervised launch: each executor group's run id, frame key and
endpoint, how the group's source rank gets them, and the line to the launcher.

Under `tp-runtime serve` the frontend is the launcher's child, beside torchrun's elastic agent
(tp_runtime/supervisor.py), on node 0 across hosts, and outlives every executor group. For each
group the engine opens a new endpoint under a new run id and new frame keys (`open_group`,
tp_runtime/group_endpoints.py); the group's source rank (the first on the frontend's host:
tp_runtime.bootstrap.bootstrap_source) asks for them on the bootstrap socket, a Unix socket in the
frontend's private 0700 directory, and broadcasts them to its peers over the gloo group. A frame of
an old group can then never pass for one of the new: another socket, another key, another run id.

The launcher tells the frontend when the agent saw a group die (which ranks, which exit codes),
and the frontend asks the launcher to SIGKILL a group it found dead or hung: SIGTERM would not end
a stopped rank, and a rank that exits 0 would read to the agent as a group that finished.

Messages on the launcher's socket pair are JSON lines:
  frontend -> launcher: {"ready": <bootstrap socket path>} or {"error": <sentence>}, then {"kill": <restart>}
  launcher -> frontend: {"died": <restart>, "exits": [[rank, exit code], ...]}
Across hosts only node 0's ranks are the launcher's: the other hosts' ranks end by themselves (their
collective fails, the scheduler goes silent, or their agent sees node 0's re-enter the rendezvous),
and their agents tell the frontend nothing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from protocol.transport import SchedulerEndpoint
from protocol.transport.ipc import private_directory
from tp_runtime.bootstrap import Bootstrap, BootstrapRequest
from tp_runtime.config import RuntimeConfig
from tp_runtime.group_endpoints import OpenedGroup, open_group, tcp_address
from tp_runtime.recovery import exit_cause

log = logging.getLogger("tp_runtime.recovery")

BOOTSTRAP_SOCKET = "bootstrap.sock"
CLAIM_TIMEOUT_S = 120.0  # a source rank waits this long for the frontend to open its group
_MAX_LINE = 1 << 16


@dataclass(frozen=True)
class DeathReport:
    """The agent saw group `restart` fail: the ranks that had ended by then and their exit codes."""

    restart: int
    exits: tuple[tuple[int, int], ...]

    def cause(self) -> str:
        # The agent SIGTERMs the ranks left once one has failed: those are its doing, not causes.
        own = [(rank, code) for rank, code in self.exits if code != -signal.SIGTERM] or self.exits
        # No exit of this host's: another host's agent re-entered the rendezvous (observed_agent).
        return "; ".join(exit_cause(rank, code) for rank, code in own) or (
            "a rank on another host ended (that host's launcher log has its exit code)"
        )


def send_line(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


class LineReader:
    """JSON lines from a stream socket, one at a time; None at its end."""

    def __init__(self, sock: socket.socket) -> None:
        self._file = sock.makefile("rb")

    def next(self) -> dict | None:
        line = self._file.readline(_MAX_LINE)
        if not line:
            return None
        return json.loads(line)


class GroupBroker:
    """Shared by the engine thread (open_group, kill, deaths), the bootstrap socket's threads
    (claim) and the launcher line's reader (group_died)."""

    def __init__(self, launcher: socket.socket, config: RuntimeConfig) -> None:
        # Its own 0700 directory: the bootstrap socket and on one host every group's frame socket,
        # removed at close() (by the launcher if this process is killed: tp_runtime/supervisor.py).
        self.directory = private_directory()
        self._config = config
        self._launcher = launcher
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._published: OpenedGroup | None = None
        self._generation = 0  # groups opened so far
        self._claimed_by: int | None = None  # the restart count of the group that took the open one
        self._deaths: deque[DeathReport] = deque()
        self._closed = False
        self.wake: Callable[[], None] = lambda: None  # set by the engine: ends its poll

    # ---- the engine thread ------------------------------------------------------------------------

    def open_group(self) -> SchedulerEndpoint:
        """A new endpoint under a new run id and keys, offered to the next group that asks. Across
        hosts it binds the same --frame-port each time: the engine closes the old group's first."""
        if self._config.multi_node:
            address = tcp_address(self._config, self._config.master_addr)
        else:
            address = f"ipc://{self.directory}/group-{self._generation}.sock"
        opened = open_group(self._config, address)
        with self._cond:
            self._generation += 1
            self._published = opened
            self._claimed_by = None
            self._cond.notify_all()
        return opened.endpoint

    def claimed_restart(self) -> int | None:
        with self._cond:
            return self._claimed_by

    def kill(self, restart: int) -> None:
        """Asks the launcher to SIGKILL every rank of group `restart` that is still there."""
        with self._send_lock:
            try:
                send_line(self._launcher, {"kill": restart})
            except OSError as exc:  # the launcher is gone: so are its ranks (PR_SET_PDEATHSIG)
                log.info("could not ask the launcher to end group %d: %s", restart, exc)

    def take_deaths(self) -> list[DeathReport]:
        with self._cond:
            deaths, self._deaths = list(self._deaths), deque()
            return deaths

    def wait_death(self, restart: int, timeout_s: float) -> DeathReport | None:
        """The launcher's report of group `restart`'s death (and any others that came meanwhile are
        kept for take_deaths), or None after timeout_s."""
        with self._cond:
            found = self._cond.wait_for(lambda: any(d.restart == restart for d in self._deaths), timeout_s)
            if not found:
                return None
            report = next(d for d in self._deaths if d.restart == restart)
            self._deaths.remove(report)
            return report

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        shutil.rmtree(self.directory, ignore_errors=True)

    # ---- other threads ----------------------------------------------------------------------------

    def claim(self, request: BootstrapRequest, timeout_s: float = CLAIM_TIMEOUT_S) -> Bootstrap:
        """The bootstrap of the open group for the source rank of group `request.restart`. If an
        older group holds the open one, that group is gone (a new one would not start otherwise): it
        is reported dead, and this waits for the engine to open the next."""
        restart = request.restart
        with self._cond:
            if self._claimed_by is not None and self._claimed_by < restart:
                self._deaths.append(DeathReport(self._claimed_by, ()))
                self._cond.notify_all()
                self.wake()
            ready = self._cond.wait_for(
                lambda: self._closed or (self._published is not None and self._claimed_by is None), timeout_s
            )
            if self._closed or not ready or self._published is None:
                return Bootstrap(error="the frontend opened no executor group in time (it is stopping, or the service has ended)")
            self._claimed_by = restart
            opened = self._published
        return opened.answer(request, self._config.tensor_parallel_size)

    def group_died(self, report: DeathReport) -> None:
        with self._cond:
            self._deaths.append(report)
            self._cond.notify_all()
        self.wake()


class BootstrapServer:
    """The Unix socket in the frontend's private directory where each group's source rank asks for
    its bootstrap: one packed BootstrapRequest in, one packed Bootstrap out."""

    def __init__(self, broker: GroupBroker) -> None:
        self.path = os.path.join(broker.directory, BOOTSTRAP_SOCKET)
        self._broker = broker
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(8)
        self._thread = threading.Thread(target=self._serve, name="bootstrap", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._answer, args=(conn,), name="bootstrap-claim", daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                line = conn.makefile("rb").readline(_MAX_LINE)
                try:
                    request = BootstrapRequest.unpack(line)
                except ValueError as exc:
                    reply = Bootstrap(error=str(exc))
                else:
                    reply = self._broker.claim(request)
                conn.sendall(reply.pack() + b"\n")
            except OSError as exc:
                log.warning("a bootstrap request failed: %s", exc)

    def close(self) -> None:
        self._sock.close()


def read_launcher(broker: GroupBroker, launcher: socket.socket, on_gone: Callable[[], None]) -> threading.Thread:
    """The thread that takes the launcher's death reports to the broker; on_gone when the line ends."""

    def run() -> None:
        reader = LineReader(launcher)
        while True:
            try:
                message = reader.next()
            except (OSError, ValueError):
                message = None
            if message is None:
                on_gone()
                return
            if "died" in message:
                exits = tuple((int(rank), int(code)) for rank, code in message.get("exits", ()))
                broker.group_died(DeathReport(int(message["died"]), exits))

    thread = threading.Thread(target=run, name="launcher-line", daemon=True)
    thread.start()
    return thread
