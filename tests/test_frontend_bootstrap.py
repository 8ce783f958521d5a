"""The frontend's Bootstrap pipe: what it does when whoever waits on the other end is gone."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tp_runtime.config import RuntimeConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")


def _frontend_whose_reader_is_gone(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """A `generate` frontend whose Bootstrap pipe's read end is closed long before it has imported
    what it needs to answer (rank 0, or the launcher, killed first): its exit code and stderr."""
    from tp_runtime.bootstrap import spawn_frontend

    started = spawn_frontend(RuntimeConfig(model=str(tmp_path / "missing.gguf")), "generate", ["hi"], [])
    os.close(started.bootstrap_fd)
    try:
        code = started.process.wait(timeout=120)
    finally:
        if started.process.poll() is None:
            started.process.kill()
            started.process.wait()
    return code, capfd.readouterr().err


def test_a_frontend_whose_reader_died_before_its_bootstrap_says_so_in_a_sentence(tmp_path, capfd):
    # The write meets a closed pipe: it was a BrokenPipeError traceback on stderr.
    code, err = _frontend_whose_reader_is_gone(tmp_path, capfd)
    assert code == 1
    assert "tp-runtime: error: the runtime failed: rank 0 exited: the runtime is down" in err
    assert "Traceback" not in err


def test_a_refusal_nobody_could_read_is_said_by_the_frontend(tmp_path, capfd, monkeypatch):
    # Across hosts with no way to share the frame key, the frontend refuses its group (a
    # ConfigError for the Bootstrap); with the reader gone, the refusal is still what it says.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    code, err = _frontend_whose_reader_is_gone(tmp_path, capfd)
    assert code == 2
    assert "tp-runtime: error: across hosts pass --frame-key-dir or --trust-rendezvous-store" in err
    assert "Traceback" not in err


def test_the_frontend_reads_back_keys_and_a_job_that_begin_with_a_dash():
    # A Z85 key may begin with "-": passed as a value of its own, argparse took it for an option and
    # the frontend exited 2 before it was ready (a two-host start failed about once in 85).
    from tp_runtime.bootstrap import frontend_arguments
    from tp_runtime.frontend import arguments

    keys = [b"-xK3#Zq", b"--@.:", b"abc-"]
    job = ["-n", "--model", "m.gguf"]
    args = arguments().parse_args(frontend_arguments(7, RuntimeConfig(model="m.gguf"), "generate", job, keys))
    assert args.bootstrap_fd == 7
    assert args.client_keys.split(",") == [k.decode() for k in keys]
    assert args.config == RuntimeConfig(model="m.gguf").to_json()
    assert (args.mode, [a for a in args.job if a != "--"]) == ("generate", job)
