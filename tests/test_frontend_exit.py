"""The frontend's forced exit (tp_runtime/frontend.py _exit_within): a clean-up that never ends
still ends the process, and its sockets' directories go with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# A frontend whose clean-up hangs after it armed the deadline: the broker's directory (given to
# _exit_within) and one of ipc_address()'s exist, and nothing else would remove them.
# With an argument, its stderr pipe is filled first (a reader that has stalled).
HANGING_CLEAN_UP = """
import os, sys, time
from protocol.transport import ipc_address
from protocol.transport.ipc import private_directory
from tp_runtime.frontend import _exit_within

if len(sys.argv) > 1:
    os.set_blocking(2, False)
    try:
        while True:
            os.write(2, b"x" * 65536)
    except BlockingIOError:
        os.set_blocking(2, True)
broker = private_directory()
address = ipc_address()
print(broker, address[len("ipc://"):].rsplit("/", 1)[0], flush=True)
_exit_within(0.2, lambda: broker)
time.sleep(120)
"""


@pytest.mark.parametrize("stderr_reader", ["open", "gone", "stalled"])
def test_a_forced_exit_removes_the_socket_directories(tmp_path: Path, stderr_reader: str) -> None:
    # "gone": stderr is a pipe nobody reads any more (the launcher killed), whose write raises;
    # "stalled": a full pipe nobody reads yet, whose write would block.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    process = subprocess.Popen(
        [sys.executable, "-c", HANGING_CLEAN_UP, *(["fill"] if stderr_reader == "stalled" else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )
    try:
        made = process.stdout.readline().split()
        assert len(made) == 2 and all(Path(d).is_dir() for d in made), made
        if stderr_reader == "gone":
            process.stderr.close()
        code = process.wait(timeout=60)
        err = process.stderr.read() if stderr_reader == "open" else ""
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
        if not process.stderr.closed:
            process.stderr.close()
    assert code == 1
    assert [d for d in made if Path(d).exists()] == []
    if stderr_reader == "open":
        assert "the frontend did not finish exiting within 0.2 s: exiting now" in err
