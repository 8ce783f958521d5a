"""The launcher's side of `tp-runtime serve`: the frontend beside torchrun's elastic agent, and the
agent restarting the executor group under it.

    launcher (torchrun's elastic agent runs in it)
     |-- frontend: HTTP server, engine, scheduler; lives as long as the service
     '-- rank 0 .. N-1: torchrun workers, restarted by the agent (--max-restarts) when one fails

Across hosts this is node 0 (the rendezvous host); the other hosts run their agents, with the same
unbounded --max-restarts, without a frontend: they rejoin the c10d rendezvous when node 0's agent
enters its next round, tell the frontend nothing, and stop at the end-of-service mark
(tp_runtime/service_end.py), which node 0 sets when its frontend exits.

The launcher starts the frontend first, with a socket pair (tp_runtime/group_broker.py says what
travels on it), and names the frontend's bootstrap socket to the ranks in their environment
(BOOTSTRAP_ENV). Then it runs the agent, which it watches through `ObservedAgent`: every failure the
agent sees (which ranks ended, with which exit code) goes to the frontend before the agent restarts
the group. The frontend answers with the groups it found dead or hung, which the launcher SIGKILLs:
a stopped rank never handles the SIGTERM the agent would send it, and the agent would wait its
whole grace period (30 s or more) before its SIGKILL.

The frontend decides when restarts must end (tp_runtime/recovery.py's window): it then exits, and
so does everything else. Whenever the frontend exits the launcher ends the launch: the ranks that
are left (after a short grace when the frontend exited cleanly, for their own exit after SHUTDOWN),
then the agent, which a SIGINT to this process stops.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable

from tp_runtime.agent_stop import AgentStop
from tp_runtime.bootstrap import BOOTSTRAP_ENV
from tp_runtime.config import ConfigError, RuntimeConfig
from tp_runtime.group_broker import LineReader, send_line
from tp_runtime.launcher import live_children, process_state
from tp_runtime.service_end import SEEN_WAIT_S
from tp_runtime.worker_process import remove_ipc_dir

log = logging.getLogger("tp_runtime.launch")

RANKS_EXIT_GRACE_S = 10.0  # after a clean frontend exit, the ranks' own exit after SHUTDOWN
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


class Supervisor:
    """The frontend process and the launcher's end of its socket pair."""

    def __init__(self, config: RuntimeConfig, nice: int, agent: AgentStop) -> None:
        ours, theirs = socket.socketpair()
        command = [
            sys.executable, "-m", "tp_runtime.frontend", "--launcher-fd", str(theirs.fileno()),
            "--config", config.to_json(), "--mode", "serve",
        ]  # fmt: skip
        self.frontend = subprocess.Popen(
            command, pass_fds=(theirs.fileno(),), preexec_fn=(lambda: os.nice(nice)) if nice else None
        )
        theirs.close()
        self._sock = ours
        self._send_lock = threading.Lock()
        self._ending = threading.Event()
        self._agent = agent
        self.frontend_code: int | None = None
        # Across hosts: the end-of-service mark for the other hosts (tp_runtime/service_end.py).
        self.before_end: Callable[[int], object] = lambda _code: None
        first = LineReader(ours).next()
        if first is None or "ready" not in first:
            code = self.frontend.wait()
            reason = (first or {}).get("error") or f"the frontend process exited with code {code} before it was ready"
            raise ConfigError(reason)
        os.environ[BOOTSTRAP_ENV] = self.bootstrap_path = first["ready"]
        threading.Thread(target=self._take_requests, name="frontend-line", daemon=True).start()
        self._watch = threading.Thread(target=self._watch_frontend, name="frontend-watch", daemon=True)
        self._watch.start()

    # ---- from the agent ---------------------------------------------------------------------------

    def group_failed(self, restart: int, exits: dict[int, int]) -> None:
        """The agent saw group `restart` fail: tell the frontend before the agent restarts it."""
        log.warning("executor group %d failed: %s", restart, exits)
        with self._send_lock, contextlib.suppress(OSError):
            send_line(self._sock, {"died": restart, "exits": sorted(exits.items())})

    # ---- from the frontend ------------------------------------------------------------------------

    def _take_requests(self) -> None:
        reader = LineReader(self._sock)
        while True:
            try:
                message = reader.next()
            except (OSError, ValueError):
                return
            if message is None:
                return
            if "kill" in message:
                kill_group(self.frontend.pid, int(message["kill"]))

    def _watch_frontend(self) -> None:
        code = self.frontend.wait()
        self.frontend_code = code
        # The frontend removes its directory as it exits; one that was killed cannot.
        remove_ipc_dir(f"ipc://{self.bootstrap_path}")
        if code == 0:  # a drain: the ranks were told to stop and exit by themselves
            _wait_for(lambda: not rank_pids(self.frontend.pid), RANKS_EXIT_GRACE_S)
        try:
            self.before_end(code)
        except Exception as exc:  # noqa: BLE001 - the store is gone: the other hosts' rendezvous fails by itself
            log.warning("could not mark the end of the service for the other hosts: %s", exc)
        self.end()

    def end(self) -> None:
        """Ends the launch: every rank now, then the agent if it still runs."""
        if self._ending.is_set():
            return
        self._ending.set()
        for pid in rank_pids(self.frontend.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._agent.stop()

    @property
    def ended(self) -> bool:
        return self._ending.is_set()

    def close(self) -> None:
        """After the agent has returned: the frontend is on its way out (or is told to go)."""
        try:
            self.frontend.wait(timeout=RANKS_EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            self.frontend.terminate()
            try:
                self.frontend.wait(timeout=RANKS_EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                self.frontend.kill()
                self.frontend.wait()
        self.frontend_code = self.frontend.returncode
        # The watch may still be marking the end in the rendezvous store (tp_runtime/agent_stop.py
        # says why the launcher must not leave before it).
        self._watch.join(RANKS_EXIT_GRACE_S + SEEN_WAIT_S + 5.0)
        self._sock.close()


def observed_agent(on_failure: Callable[[int, dict[int, int]], None] | None, hosts: int = 1) -> type:
    """torchrun's LocalElasticAgent, with four changes. It tells on_failure(restart count, {rank:
    exit code}) of every group that ends before it restarts it (the agent keeps no record a caller
    could read); the other hosts' agents pass None. It counts every restart: torch's counts only a
    failed group, not a restart because another host's agent re-entered the rendezvous, and the
    frontend (which group to kill, whose death it was told of) and the ranks (their keys in the
    group's store) tell groups apart by TORCHELASTIC_RESTART_COUNT, which must then be new for every
    group and the same on every host. And its stop SIGKILLs a stopped rank at once: SIGTERM never
    ends one, and the agent would wait its whole grace period before its SIGKILL. And the agent of
    a launch on one host (`hosts` 1) never asks the rendezvous whether another host waits to join:
    none can, and torch asks at every look at the ranks (five times a second), a round trip to the
    store and a decode of its state that were half of an idle launcher's CPU. And on one host, while
    the group runs, the agent waits for a rank to exit (RankExits) between its looks, instead of
    looking five times a second: then nothing else can change what a look finds."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class ObservedAgent(LocalElasticAgent):
        _running = 0  # the restart count of the group the agent started last
        _reported = -1  # the last group on_failure was told of
        _healthy = False  # the last look found the group running
        _exits: RankExits | None = None  # one host's: its looks wait for a rank to exit

        def __init__(self, spec, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN204 (torch's signature)
            if hosts == 1:
                spec.rdzv_handler.num_nodes_waiting = _no_host_waits
            self._exits = RankExits() if hosts == 1 else None
            super().__init__(spec, *args, **kwargs)

        def _monitor_workers(self, worker_group):  # noqa: ANN001, ANN202 (torch's signature)
            # torch's check for ranks stuck in the D state (2.13's, off unless asked for) needs its
            # looks on time.
            stuck_check = getattr(self, "_uninterruptible_state_timeout", 0) > 0
            if self._exits is not None and self._healthy and not stuck_check:
                self._exits.wait(self._pcontext.pids().values(), QUIET_LOOK_S)
            result = super()._monitor_workers(worker_group)
            self._healthy = result.state == WorkerState.HEALTHY
            if result.state.name in ("FAILED", "UNHEALTHY") and on_failure is not None and self._reported != self._running:
                self._reported = self._running
                on_failure(self._running, {rank: failure.exitcode for rank, failure in result.failures.items()})
            return result

        def _restart_workers(self, worker_group):  # noqa: ANN001, ANN202
            spec = worker_group.spec
            if spec.max_restarts - self._remaining_restarts == self._running:  # not counted by torch
                self._remaining_restarts -= 1
                if on_failure is not None and self._reported != self._running:
                    self._reported = self._running
                    on_failure(self._running, {})
            self._running = spec.max_restarts - self._remaining_restarts
            self._healthy = False  # a new group: torch's first look checks its pids
            super()._restart_workers(worker_group)

        # Whatever torch's run() passes goes on as it came: torch 2.11's _shutdown takes no timeout
        # (2.13's does), and a fixed signature here crashed the agent's stop on the older one.
        def _shutdown(self, death_sig=signal.SIGTERM, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if self._pcontext is not None:
                kill_stopped(self._pcontext.pids().values())
            try:
                super()._shutdown(death_sig, *args, **kwargs)
                stop_heartbeats(self._worker_group.spec.rdzv_handler)
            finally:
                if self._exits is not None:
                    self._exits.close()

    return ObservedAgent


def _no_host_waits() -> int:
    return 0


# How long a one-host agent waits between looks at a group none of whose ranks exits. A look then
# finds nothing new, so this bounds nothing that matters; an exit wakes the agent at once.
QUIET_LOOK_S = 5.0


class RankExits:
    """Waits until one of the ranks exits (Linux's pidfds of the processes, polled), for at most a
    given time. Each of the agent's looks at the ranks is a wake-up of the launcher's main thread,
    ~0.2 ms of CPU on a virtual machine: five a second were ~1 ms of CPU a second, under load as
    idle (docs/control_plane.md). Where pidfds are missing (not Linux, a kernel before 5.3) it
    returns at once, and torch's own interval (--monitor-interval) paces the looks."""

    def __init__(self) -> None:
        self._pids: tuple[int, ...] = ()
        self._fds: list[int] = []
        self._poller: select.poll | None = None  # None: return at once
        self._unsupported = not hasattr(os, "pidfd_open")

    def wait(self, pids: Iterable[int], timeout_s: float) -> None:
        pids = tuple(sorted(pids))
        if pids != self._pids:
            self._watch(pids)
        if self._poller is not None:
            self._poller.poll(int(timeout_s * 1000))

    def _watch(self, pids: tuple[int, ...]) -> None:
        self.close()
        self._pids = pids  # a group whose pidfds fail is not tried again at every look
        if self._unsupported:
            return
        try:
            for pid in pids:
                self._fds.append(os.pidfd_open(pid))
        except OSError as exc:  # a rank reaped already (ESRCH), no pidfds here, or no descriptor left
            self._unsupported = exc.errno in (errno.ENOSYS, errno.EPERM)
            return  # without a poller: torch's look, at once, finds the reaped rank
        self._poller = select.poll()
        for fd in self._fds:
            self._poller.register(fd, select.POLLIN)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds, self._poller, self._pids = [], None, ()


def stop_heartbeats(handler: object) -> None:
    """Stops the rendezvous handler's keep-alive timer once the agent is done with it. torch's
    launcher skips the handler's shutdown when a signal stopped the agent (so as not to close the
    rendezvous for the other hosts), and the timer runs on until the handler is freed; freed on the
    timer's own thread (a tick holds the last reference), the timer's finalizer joins that thread and
    the launcher prints "RuntimeError: cannot join current thread" as it exits. A rendezvous without
    heartbeats has none to stop."""
    stop = getattr(handler, "_stop_heartbeats", None)
    if stop is not None:
        stop()


def kill_stopped(pids: Iterable[int]) -> None:
    """SIGKILLs those of `pids` that are stopped (state T: SIGSTOP, or a debugger's)."""
    for pid in pids:
        if process_state(pid) == "T":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def agent_observed_by(supervisor: Supervisor | None, hosts: int):
    """torchrun's launcher builds its agent by the name LocalElasticAgent in its module: the
    observed one takes that name while the launch runs (on a host without the frontend, one that
    reports to nobody)."""
    import torch.distributed.launcher.api as launcher_api

    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = observed_agent(supervisor.group_failed if supervisor is not None else None, hosts)
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original


def rank_pids(frontend_pid: int, restart: int | None = None) -> list[int]:
    """This process's children that torchrun's agent started (of group `restart` when given)."""
    found = []
    for pid in live_children():
        if pid == frontend_pid:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.partition(b"=")[::2] for item in f.read().split(b"\0") if item)
        except OSError:
            continue
        count = env.get(RESTART_COUNT_ENV.encode())
        if count is not None and (restart is None or int(count) == restart):
            found.append(pid)
    return found


def kill_group(frontend_pid: int, restart: int) -> None:
    pids = rank_pids(frontend_pid, restart)
    log.warning("the frontend found executor group %d dead or hung: SIGKILL to %s", restart, pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_for(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
