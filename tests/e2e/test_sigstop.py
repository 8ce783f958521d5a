"""SIGSTOP of one rank of a TP=2 server while streams run: the frontend notices its silence (every
executor heartbeats beside its forward), /health turns 503 within the peer-silence window, every
stream fails with an error event that names the stopped rank, and no process of the group is left,
the stopped one included. With --max-restarts 0: under the default the group restarts
(tests/e2e/test_recovery.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from scripts.harness.client import BackgroundStreams, CompletionRequest, served_model
from scripts.harness.runtime import RuntimeServer, ServerOptions
from tp_runtime.step_loop import EngineTimeouts

OPTIONS = (
    "--dtype", "fp32", "--num-kv-pages", "256", "--max-model-len", "2048", "--max-num-seqs", "8", "--max-restarts", "0",
)  # fmt: skip
# The frontend's peer-silence window, plus the time /health and a busy 2-core machine take to tell.
NOTICED_S = EngineTimeouts().peer_silence_s + 1.5
GONE_S = 15.0  # the launcher SIGKILLs the stopped rank once its peer has exited


@pytest.mark.parametrize("rank", [1, 0])
def test_a_stopped_rank_turns_health_503_fails_the_streams_naming_it_and_leaves_nothing(
    rank: int, tiny_model: Path, tmp_path: Path
) -> None:
    options = ServerOptions(model=str(tiny_model), tensor_parallel_size=2, extra_args=OPTIONS)
    with RuntimeServer(options, log_path=tmp_path / "server.log") as server:
        model = served_model(server.url)
        requests = [CompletionRequest(prompt_ids=(9 + i, 8, 7), max_tokens=1500, ignore_eos=True) for i in range(3)]
        streams = BackgroundStreams(server.url, model, requests, timeout_s=60).start()
        assert streams.wait_streaming(min_tokens=2, timeout_s=60), "the streams never started"
        stopped = server.signal(rank, signal.SIGSTOP)
        change = server.wait_health(lambda status: status != 200, timeout_s=NOTICED_S)
        assert change.status in (503, None), change
        results = streams.join(timeout_s=30)
        for result in results:
            assert result.error is not None and not result.completed, (result.finish_reason, len(result.token_ids))
            assert f"rank {rank}" in result.error and "stopped answering" in result.error, result.error
            assert result.done_markers == 1, result.error
        left = server.wait_gone(GONE_S)
        assert not left, f"after SIGSTOP of rank {rank}: {server.left_report(left)}"
        assert not stopped.alive()
