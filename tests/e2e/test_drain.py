"""SIGTERM drains: no new requests, the running one finishes, then a clean exit."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.serving import RecordedStream, Server, alive, descendants


def test_sigterm_lets_running_requests_finish_then_exits_cleanly(tiny_model: Path) -> None:
    # Long enough that the stream is still running when SIGTERM lands even on a quiet machine: the
    # test waits for its first token (an event), not for a metrics poll that a fast request can
    # slip between.
    options = ("--dtype", "fp32", "--num-kv-pages", "256", "--max-model-len", "2048", "--max-num-seqs", "4")
    server = Server(tiny_model, tp=2, extra=options)
    try:
        group = [server.pid, *descendants(server.pid)]
        stream = RecordedStream(
            server.url, "drain me", 1500, timeout_s=120, temperature=0, stream_options={"include_usage": True}
        )
        stopped_at = time.monotonic()
        os.kill(server.pid, signal.SIGTERM)
        refused = None
        while stream.ended_at is None:
            try:
                late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
                if late.status_code != 200:
                    refused = late
                    break
            except httpx.HTTPError:
                break
            time.sleep(0.05)
        stream.join(120)
        assert stream.ended_at is not None and stream.ended_at > stopped_at, "the stream ended before SIGTERM"
        data = [line for line in stream.lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]", data[-3:]
        assert not any('"error"' in line for line in data), [line for line in data if '"error"' in line][:1]
        assert any('"finish_reason":"length"' in line.replace(" ", "") for line in data[-3:]), data[-3:]
        usage = json.loads(data[-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 1500, usage
        if refused is not None:
            assert refused.status_code == 503, refused.text
        assert server.process.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while alive(group) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(group), f"processes left behind: {alive(group)}"
    finally:
        server.stop()


def test_a_stream_longer_than_the_drain_gets_an_error_and_the_group_exits_before_torchrun_would_kill_it(
    tiny_model: Path,
) -> None:
    options = ("--dtype", "fp32", "--num-kv-pages", "256", "--max-model-len", "2048", "--max-num-seqs", "4")
    drain_s = 2.0
    server = Server(tiny_model, tp=2, extra=(*options, "--shutdown-timeout", str(drain_s)))
    try:
        group = [server.pid, *descendants(server.pid)]
        stream = RecordedStream(server.url, "on and on", 2000, timeout_s=60)
        stopped_at = time.monotonic()
        os.kill(server.pid, signal.SIGTERM)
        stream.join(30)
        assert stream.ended_at is not None, "the stream did not end"
        took = stream.ended_at - stopped_at
        assert drain_s - 0.5 < took < drain_s + 5, f"the stream ended {took:.1f} s after SIGTERM"
        data = [line for line in stream.lines if line.startswith("data: ")]
        assert any('"error"' in line and "shutting down" in line for line in data[-2:]), data[-3:]
        assert server.process.wait(timeout=30) == 0
        exited = time.monotonic() - stopped_at
        # torchrun's grace period is 30 s: the group left long before it would have been killed.
        assert exited < drain_s + 10, f"the group took {exited:.1f} s to stop"
        deadline = time.monotonic() + 10
        while alive(group) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(group), f"processes left behind: {alive(group)}"
    finally:
        server.stop()


def test_the_launcher_gives_torchrun_a_grace_period_longer_than_the_drain() -> None:
    from torch.distributed.run import config_from_args, get_args_parser

    from tp_runtime import launcher as launch
    from tp_runtime.config import RuntimeConfig

    assert launch.torchrun_grace_s(RuntimeConfig(model="m")) == launch.TORCHRUN_DEFAULT_GRACE_S  # the default fits
    for drain in (0.0, 20.0, 45.5, 600.0):
        config = RuntimeConfig(model="m", shutdown_timeout=drain)
        grace = launch.torchrun_grace_s(config)
        assert grace >= drain + launch.STOP_MARGIN_S and grace >= launch.TORCHRUN_DEFAULT_GRACE_S
        argv = launch.torchrun_argv(config, "127.0.0.1:29500", "127.0.0.1", ["serve"])
        launch_config, _, _ = config_from_args(get_args_parser().parse_args(argv))
        assert launch_config.shutdown_timeout == grace  # what torch's agent will wait before SIGKILL


def test_under_plain_torchrun_a_drain_longer_than_its_grace_period_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from tp_runtime.config import ConfigError, RuntimeConfig
    from tp_runtime.launcher import check_drain_fits

    monkeypatch.delenv("PET_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
    check_drain_fits(RuntimeConfig(model="m", shutdown_timeout=20))
    with pytest.raises(ConfigError, match="give torchrun --shutdown-timeout 35"):
        check_drain_fits(RuntimeConfig(model="m", shutdown_timeout=25))
    monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", "60")  # torchrun --shutdown-timeout 60, through its environment
    check_drain_fits(RuntimeConfig(model="m", shutdown_timeout=25))
