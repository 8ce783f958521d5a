"""The frontend's priority: below the ranks' on the CPU, where it shares the cores with the forward;
the flag overrides it, and only values that lower the priority are taken."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tp_runtime.bootstrap import CPU_FRONTEND_NICE, frontend_nice
from tp_runtime.cli import build_parser, config_from_args
from tp_runtime.config import RuntimeConfig


def test_the_default_is_lower_on_the_cpu_only():
    assert frontend_nice(RuntimeConfig(model="m"), use_cuda=False) == CPU_FRONTEND_NICE > 0
    assert frontend_nice(RuntimeConfig(model="m"), use_cuda=True) == 0
    assert frontend_nice(RuntimeConfig(model="m", frontend_nice=3), use_cuda=False) == 3
    args = build_parser().parse_args(["serve", "--model", "m", "--frontend-nice", "0"])
    assert config_from_args(args).frontend_nice == 0


def test_a_value_that_would_raise_the_priority_is_refused():
    done = subprocess.run(
        [sys.executable, "-m", "tp_runtime", "serve", "--frontend-nice", "-5"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TP_RUNTIME_COMPILE": "off"},
    )  # fmt: skip
    assert done.returncode == 2
    assert "--frontend-nice takes 0 to 19" in done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_frontend_process_runs_at_that_nice_value(tmp_path):
    from tp_runtime.bootstrap import read_bootstrap, spawn_frontend

    config = RuntimeConfig(model=str(tmp_path / "missing.gguf"))
    started = spawn_frontend(config, "generate", ["hi"], [], nice=7)
    child = started.process
    read_bootstrap(started.bootstrap_fd)  # the frontend has bound: it is still there, at its nice value
    try:
        with open(f"/proc/{child.pid}/stat") as f:
            nice = int(f.read().rsplit(")", 1)[1].split()[16])
        assert nice == os.nice(0) + 7
    finally:
        child.kill()
        child.wait()
