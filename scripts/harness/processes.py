"""Processes by pid: identity, the tree below a pid, signals, memory, and the tags that find them.

Linux /proc only. A pid is reused once its process is reaped, so a `ProcessRef` also carries the
process's start time: a ref whose pid now belongs to another process reads as gone and is never
signalled. Every process the harness starts carries two environment variables that its own children
inherit (torchrun's workers, rank 0's frontend): `TP_HARNESS_RUN`, one value per test session or
tool run, and `TP_HARNESS_CLUSTER`, one value per started cluster. Reading them back from
/proc/<pid>/environ finds a cluster's processes even after their parent died and they were
reparented, which a walk down from the launcher cannot.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_ENV = "TP_HARNESS_RUN"
CLUSTER_ENV = "TP_HARNESS_CLUSTER"
_GONE_STATES = ("Z", "X")  # a zombie has exited; only its parent's wait is missing


@dataclass(frozen=True)
class _Stat:
    state: str
    ppid: int
    start_ticks: int


def rank_label(rank: int) -> str:
    """How the harness names the process of a rank, in every cluster and every report."""
    return f"rank{rank}"


def _stat(pid: int) -> _Stat | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields after the last ')' are fixed.
    fields = text.rsplit(")", 1)[1].split()
    return _Stat(state=fields[0], ppid=int(fields[1]), start_ticks=int(fields[19]))


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time the process has used so far (all its threads), or None if gone.

    From the process's CPU clock where Linux gives it (what clock_getcpuclockid would return:
    CPUCLOCK_SCHED of the pid), exact to the nanosecond; /proc's stat counts 10 ms ticks, each
    charged to whatever ran at the tick, too coarse for a thread that wakes for 0.1 ms per step."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except (OSError, OverflowError):
        pass
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def cmdline(pid: int) -> str:
    """The command line with spaces between arguments; empty once the process has gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def environ(pid: int) -> dict[str, str]:
    """The environment the process started with; empty when gone or not ours to read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


def forked_rank(pid: int) -> str | None:
    """The rank of a process that `tp-runtime generate`'s launcher forked (tp_runtime/local_launch.py
    names its main thread RANK_THREAD_PREFIX + rank), else None."""
    from tp_runtime.local_launch import RANK_THREAD_PREFIX

    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    return name.removeprefix(RANK_THREAD_PREFIX) if name.startswith(RANK_THREAD_PREFIX) else None


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a live process, None once it has gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


_LISTENING = 0x00010000  # __SO_ACCEPTCON in /proc/net/unix's Flags column


def listening_unix_sockets(pid: int) -> list[str]:
    """The paths of the Unix sockets that `pid` listens on (an ipc:// ZeroMQ endpoint is one)."""
    inodes = set()
    try:
        entries = list(Path(f"/proc/{pid}/fd").iterdir())
        table = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return []
    for entry in entries:
        try:
            target = os.readlink(entry)
        except OSError:  # closed since the listing: a busy server opens and closes connections
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    paths = []
    for line in table:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and int(fields[3], 16) & _LISTENING:
            paths.append(fields[7])
    return sorted(paths)


@dataclass(frozen=True)
class ProcessRef:
    """One process: its pid, its start time (which tells a reused pid apart) and a label."""

    pid: int
    start_ticks: int
    label: str

    @classmethod
    def of(cls, pid: int, label: str = "") -> ProcessRef | None:
        """The process now holding `pid`, or None if there is none."""
        stat = _stat(pid)
        if stat is None or stat.state in _GONE_STATES:
            return None
        return cls(pid, stat.start_ticks, label or f"pid {pid}")

    def _current(self) -> _Stat | None:
        stat = _stat(self.pid)
        return stat if stat is not None and stat.start_ticks == self.start_ticks else None

    def alive(self) -> bool:
        stat = self._current()
        return stat is not None and stat.state not in _GONE_STATES

    def stopped(self) -> bool:
        """Stopped by a signal (SIGSTOP, SIGTSTP), as `kill -STOP` leaves it."""
        stat = self._current()
        return stat is not None and stat.state == "T"

    def signal(self, sig: signal.Signals) -> bool:
        """Sends sig if this very process is still there; True when it was delivered."""
        if not self.alive():
            return False
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def rss_bytes(self) -> int | None:
        return rss_bytes(self.pid) if self.alive() else None

    def describe(self) -> str:
        return f"{self.label} (pid {self.pid}: {cmdline(self.pid)[:160] or 'gone'})"


def descendants(root: int) -> list[int]:
    """Live processes below `root`, children before grandchildren.

    torchrun starts each worker in a session of its own, so a process group would not hold them;
    the parent links in /proc do.
    """
    parents = {}
    for pid in _pids():
        stat = _stat(pid)
        if stat is not None and stat.state not in _GONE_STATES:
            parents[pid] = stat.ppid
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop(0)
        children = sorted(pid for pid, ppid in parents.items() if ppid == parent)
        found.extend(children)
        frontier.extend(children)
    return found


def alive(pids: Iterable[int]) -> list[int]:
    """The pids among `pids` that a live (not zombie) process holds."""
    return [pid for pid in pids if ProcessRef.of(pid) is not None]


def tagged(name: str, value: str) -> list[ProcessRef]:
    """Live processes that started with `name=value` in their environment, this one excepted."""
    found = []
    for pid in _pids():
        if pid != os.getpid() and environ(pid).get(name) == value:
            ref = ProcessRef.of(pid)
            if ref is not None:
                found.append(ref)
    return found


def wait_gone(refs: Iterable[ProcessRef], timeout_s: float, interval_s: float = 0.05) -> list[ProcessRef]:
    """Waits until none of refs is alive; returns those still alive at the timeout."""
    remaining = [ref for ref in refs if ref.alive()]
    deadline = time.monotonic() + timeout_s
    while remaining and time.monotonic() < deadline:
        time.sleep(interval_s)
        remaining = [ref for ref in remaining if ref.alive()]
    return remaining


def run_tag() -> str:
    """This run's tag: the test session's (set by the leak check) or one made for this process."""
    if RUN_ENV not in os.environ:
        os.environ[RUN_ENV] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return os.environ[RUN_ENV]


def child_env(cluster_tag: str, extra: Mapping[str, str] | None = None, checkout: Path = REPO_ROOT) -> dict[str, str]:
    """The environment of a started process: ours, the checkout first on PYTHONPATH, the tags."""
    path = os.pathsep.join(filter(None, (str(checkout), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path, RUN_ENV: run_tag(), CLUSTER_ENV: cluster_tag, **(extra or {})}


def spawn(
    argv: list[str],
    *,
    cluster_tag: str,
    log_path: Path | None,
    env: Mapping[str, str] | None = None,
    checkout: Path = REPO_ROOT,
) -> subprocess.Popen[bytes]:
    """Starts `python <argv>` from a checkout (this one, or another tree to compare with) in a
    session of its own (a Ctrl-C meant for the caller does not reach it; the caller stops it by
    pid). Output goes to log_path, or to ours."""
    log = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "wb")  # noqa: SIM115 (the child holds it; ours closes below)
    try:
        return subprocess.Popen(
            [sys.executable, *argv],
            stdout=log,
            stderr=subprocess.STDOUT if log is not None else None,
            stdin=subprocess.DEVNULL,
            cwd=checkout,
            env=child_env(cluster_tag, env, checkout),
            start_new_session=True,
        )
    finally:
        if log is not None:
            log.close()


class ProcessTracker:
    """Every process of one cluster, by label, plus any other that carries the cluster's tag."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex
        self._known: dict[str, ProcessRef] = {}

    def add(self, ref: ProcessRef) -> None:
        self._known[ref.label] = ref

    def get(self, label: str) -> ProcessRef:
        if label not in self._known:
            raise KeyError(f"no process labelled {label!r}; known: {sorted(self._known)}")
        return self._known[label]

    def known(self) -> dict[str, ProcessRef]:
        return dict(self._known)

    def survivors(self) -> list[ProcessRef]:
        """Known processes still alive, and unknown ones that carry this cluster's tag (a child
        started after the last look, or an orphan whose parent was killed)."""
        live = [ref for ref in self._known.values() if ref.alive()]
        seen = {ref.pid for ref in live}
        return live + [ref for ref in tagged(CLUSTER_ENV, self.tag) if ref.pid not in seen]

    def kill_survivors(self) -> list[ProcessRef]:
        """SIGKILL to every survivor, by pid; returns the ones that were still there."""
        return [ref for ref in self.survivors() if ref.signal(signal.SIGKILL)]


def free_port() -> int:
    """A loopback TCP port that nothing listens on at this moment."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def bind_error(port: int) -> str | None:
    """None when a loopback TCP port can be listened on now (with uvicorn's SO_REUSEADDR), else why not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
            probe.listen()
        except OSError as exc:
            return str(exc)
    return None
