"""Kill one rank mid-generation with --max-restarts 0 (a failed rank ends the service): clients get
an error within 5 s, /health turns 503, and no process of the group is left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.serving import SERVER_OPTIONS, RecordedStream, Server, alive, descendants, rank_pid
from tp_runtime.launcher import STOP_MARGIN_S


def test_killed_rank_fails_requests_fast_and_leaves_nothing_behind(tiny_model: Path) -> None:
    server = Server(tiny_model, tp=2, extra=(*SERVER_OPTIONS, "--max-restarts", "0"))
    try:
        group = [server.pid, *descendants(server.pid)]
        stream = RecordedStream(server.url, "keep going", 240)
        health_codes: list[int] = []
        killed_at = time.monotonic()
        os.kill(rank_pid(server.pid, 1), signal.SIGKILL)
        # /health must turn 503 (or the server be gone) within 5 s, whether or not the stream has
        # already ended by then.
        while time.monotonic() - killed_at < 5 and not (503 in health_codes or -1 in health_codes):
            try:
                health_codes.append(httpx.get(f"{server.url}/health", timeout=1).status_code)
            except httpx.HTTPError:
                health_codes.append(-1)
            time.sleep(0.05)
        stream.join(max(0.1, 6 - (time.monotonic() - killed_at)))
        assert stream.ended_at is not None, "the stream did not end after a rank died"
        assert stream.ended_at - killed_at < 5, f"the client waited {stream.ended_at - killed_at:.1f} s"
        tail = "\n".join([line for line in stream.lines if line][-3:])  # the error event, then [DONE]
        assert "error" in tail.lower(), f"the stream ended without an error: {tail}"
        assert 503 in health_codes or -1 in health_codes, health_codes
        deadline = time.monotonic() + 20
        while alive(group) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(group), f"processes left behind: {alive(group)}"
        assert server.process.wait(timeout=5) != 0
    finally:
        server.stop()


def frontend_pid(root: int) -> int:
    for pid in descendants(root):
        try:
            if b"tp_runtime.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise LookupError(f"no frontend process below {root}")


def ipc_dirs(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("tp-runtime-*"))


def test_rank_0_removes_the_ipc_directory_after_a_kill_9_of_the_frontend(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the group makes its ipc directory here
    server = Server(tiny_model, tp=1, extra=SERVER_OPTIONS)
    try:
        group = [server.pid, *descendants(server.pid)]
        assert len(ipc_dirs(tmp_path)) == 1, ipc_dirs(tmp_path)
        os.kill(frontend_pid(server.pid), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while alive(group) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(group), f"processes left behind: {alive(group)}"
        assert server.process.wait(timeout=5) != 0
        assert ipc_dirs(tmp_path) == [], f"left behind in {tmp_path}: {ipc_dirs(tmp_path)}"
    finally:
        server.stop()


@contextlib.contextmanager
def _rank_0_killed_once_the_directory_exists(
    command: list[str], tmp_path: Path, poll_s: float
) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """`generate` (command) with its ipc directory under tmp_path, rank 0 SIGKILLed as soon as the
    directory exists. Yields the launcher and the group's pids taken before the kill; whatever is
    still alive after is SIGKILLed by those ids (an orphaned frontend is no descendant any more)."""
    process = subprocess.Popen(command, start_new_session=True, env={**os.environ, "TMPDIR": str(tmp_path)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    group = [process.pid]
    try:
        deadline = time.monotonic() + 120
        while not ipc_dirs(tmp_path):
            assert process.poll() is None and time.monotonic() < deadline, "the frontend never made its directory"
            time.sleep(poll_s)
        group = [process.pid, *descendants(process.pid)]
        os.kill(rank_pid(process.pid, 0), signal.SIGKILL)
        yield process, group
    finally:
        for pid in alive([*group, *descendants(process.pid)]):
            os.kill(pid, signal.SIGKILL)


def test_generate_ends_at_once_when_rank_0_dies_before_its_hello(tmp_path: Path) -> None:
    """A rank killed before its HELLO leaves no connection whose close the frontend could see: the
    launcher tells it (RANK_ENDED_SIGNAL). Without that it waited in its handshake until the
    stragglers' watch SIGKILLed it STOP_MARGIN_S later, its ipc directory left, nothing said.
    The embedded model, whose load keeps rank 0 from its HELLO well after the directory exists."""
    command = [sys.executable, "-m", "tp_runtime", "generate", "go on", "--raw", "--max-tokens", "8", "--log-level", "error"]
    with _rank_0_killed_once_the_directory_exists(command, tmp_path, poll_s=0.002) as (process, _group):
        _, err = process.communicate(timeout=STOP_MARGIN_S - 2)  # the watch's SIGKILL comes at STOP_MARGIN_S
        assert process.returncode == 1, err[-2000:]
        assert "a rank exited with a failure" in err, err[-2000:]
        assert ipc_dirs(tmp_path) == [], f"left behind in {tmp_path}: {ipc_dirs(tmp_path)}; {err[-2000:]}"


def test_the_frontend_removes_the_ipc_directory_after_a_kill_9_of_rank_0(tiny_model: Path, tmp_path: Path) -> None:
    """During `generate`, whose frontend had no handler for its parent's death."""
    command = [
        sys.executable, "-m", "tp_runtime", "generate", "go on", "--model", str(tiny_model), "--raw", "--dtype", "fp32",
        "--num-kv-pages", "160", "--max-model-len", "2048", "--max-tokens", "2000", "--log-level", "error",
    ]
    with _rank_0_killed_once_the_directory_exists(command, tmp_path, poll_s=0.05) as (process, group):
        _, err = process.communicate(timeout=30)
        assert process.returncode != 0
        deadline = time.monotonic() + 10
        while alive(group) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(group), f"processes left behind: {alive(group)}"
        assert ipc_dirs(tmp_path) == [], f"left behind in {tmp_path}: {ipc_dirs(tmp_path)}; {err[-2000:]}"
