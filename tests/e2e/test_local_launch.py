"""`tp-runtime generate` on one host starts its frontend and its ranks itself (tp_runtime/local_launch.py):
the same text as plain torchrun, ranks forked on the CPU or started as new interpreters (the start
used with CUDA, exercised here on the CPU), every process the launcher's child, and a Ctrl-C that
leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.harness.processes import alive, descendants
from scripts.harness.runtime import process_label
from tp_runtime.config import RuntimeConfig
from tp_runtime.local_launch import rank_starts, runs_locally

GENERATE = ["generate", "Hello", "--raw", "--dtype", "fp32", "--num-kv-pages", "160", "--max-model-len", "512"]


def _run(command: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """One thread per rank in every launch, so that the three sum alike and greedy text can be compared."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, start_new_session=True, env=env)


def _generate(model: Path, tp: int, *extra: str) -> list[str]:
    return [*GENERATE, "--model", str(model), "--tensor-parallel-size", str(tp), "--max-tokens", "12", *extra]


def test_only_generate_on_one_host_runs_without_torchrun() -> None:
    one_host = RuntimeConfig(model="m")
    assert runs_locally(one_host, ["generate", "hi"])
    assert not runs_locally(one_host, ["serve"])
    assert not runs_locally(RuntimeConfig(model="m", nnodes=2, nproc_per_node=1), ["generate", "hi"])


def test_each_rank_gets_torchrun_s_variables_and_rank_0_the_frontend_s_pipe() -> None:
    starts = rank_starts(world=2, threads=1, bootstrap_fd=7, store=None)
    for start in starts:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
            assert name in start.env, name
        assert start.env["RANK"] == start.env["LOCAL_RANK"] == str(start.rank)
        assert start.env["WORLD_SIZE"] == start.env["LOCAL_WORLD_SIZE"] == "2"
    assert starts[0].env["TP_RUNTIME_BOOTSTRAP_FD"] == "7" and starts[0].fds == (7,)
    assert "TP_RUNTIME_BOOTSTRAP_FD" not in starts[1].env and starts[1].fds == ()


@pytest.mark.parametrize("tp", [1, 2])
def test_forked_and_spawned_ranks_and_plain_torchrun_generate_the_same_text(tiny_model: Path, tp: int) -> None:
    forked = _run([sys.executable, "-m", "tp_runtime", *_generate(tiny_model, tp)])
    assert forked.returncode == 0, forked.stderr[-2000:]
    assert forked.stdout.strip()
    # The start CUDA gets (a new interpreter per rank), taken on the CPU: the launcher sees a second thread.
    spawned = _run([
        sys.executable, "-c",
        "import sys, threading; threading.active_count = lambda: 2; from tp_runtime.cli import main; sys.exit(main())",
        *_generate(tiny_model, tp),
    ])  # fmt: skip
    assert spawned.returncode == 0, spawned.stderr[-2000:]
    torchrun = _run([
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp),
        "-m", "tp_runtime", *_generate(tiny_model, tp),
    ])  # fmt: skip
    assert torchrun.returncode == 0, torchrun.stderr[-2000:]
    assert forked.stdout == spawned.stdout == torchrun.stdout


def test_the_frontend_and_the_ranks_are_the_launcher_s_children_and_a_ctrl_c_stops_them(tiny_model: Path) -> None:
    command = [sys.executable, "-m", "tp_runtime", *_generate(tiny_model, 2), "--stream"]
    command[command.index("--max-tokens") + 1] = "1500"
    command[command.index("--max-model-len") + 1] = "2048"
    launcher = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    group: list[int] = [launcher.pid]
    try:
        assert launcher.stdout.read(1), "no token came"  # every process is up and generating
        group += descendants(launcher.pid)
        labels = {process_label(pid): pid for pid in group[1:]}
        assert set(labels) == {"frontend", "rank0", "rank1"}, labels
        for pid in labels.values():
            assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher.pid
        launcher.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends the launcher alone
        assert launcher.wait(timeout=30) != 0
        deadline = time.monotonic() + 15
        while alive(group) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(group), f"left behind: {alive(group)}"
    finally:
        for pid in alive(group):
            os.kill(pid, signal.SIGKILL)
        launcher.stdout.close()
        launcher.wait()
