"""A real `tp-runtime serve` process group for end-to-end tests, always stopped by its id."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# Small enough that a TP=2 step over gloo is a few milliseconds; 3 KV groups over 2 ranks exercise
# the uneven head split.
SERVER_OPTIONS = (
    "--dtype", "fp32", "--num-kv-pages", "256", "--max-model-len", "256", "--max-num-seqs", "32",
    "--max-num-batched-tokens", "256",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[1])


def descendants(root: int) -> list[int]:
    """Live processes below `root` (torchrun starts each worker in a session of its own, so a
    process group would not hold them)."""
    parents = {int(e.name): _ppid(int(e.name)) for e in Path("/proc").iterdir() if e.name.isdigit()}
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found.extend(children)
        frontier.extend(children)
    return found


def alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if _ppid(pid) is not None]


def rank_pid(root: int, rank: int) -> int:
    """The torchrun worker of `rank`: RANK=n in its environment and not the frontend child."""
    for pid in descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"tp_runtime.frontend" not in cmdline:
            return pid
    raise LookupError(f"no process of rank {rank} below {root}")


class Server:
    def __init__(self, model: str | Path, *, tp: int = 1, extra: tuple[str, ...] = (), startup_s: float = 180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "tp_runtime", "serve", "--model", str(model), "--tensor-parallel-size", str(tp),
            "--port", str(self.port), "--log-level", "warning", *extra,
        ]
        self.process = subprocess.Popen(command, start_new_session=True)
        self.pid = self.process.pid
        self.pids = [self.pid]
        deadline = time.monotonic() + startup_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.process.returncode} during start-up")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.pids = [self.pid, *descendants(self.pid)]
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the server did not become healthy within {startup_s} s")
            time.sleep(0.3)

    def stop(self, timeout_s: float = 20) -> None:
        """SIGTERM to the launcher (torchrun passes it on and the frontend drains), then SIGKILL to
        every process of the group that is still there, by pid."""
        self.pids = list(dict.fromkeys([*self.pids, *descendants(self.pid)]))
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout_s
        while alive(self.pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in alive(self.pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
