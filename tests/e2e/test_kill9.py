"""kill -9 of each process of a TP=2 server in turn (torchrun's agent in the launcher, rank 0, rank 1,
the frontend) while streams run: every process of the group ends (checked by pid), every in-flight
stream ends with an error (an error event and its [DONE] where the HTTP server survives the kill),
the ipc directory is removed and the port can be bound again at once. With --max-restarts 0: a rank
killed under the default restarts (tests/e2e/test_recovery.py)."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from scripts.harness.client import BackgroundStreams, CompletionRequest, served_model
from scripts.harness.runtime import FRONTEND, LAUNCHER, RuntimeServer, ServerOptions

# Long outputs (the streams must still run when the kill lands) and a short drain: a launcher killed
# by SIGKILL makes its ranks drain (PR_SET_PDEATHSIG), which must cut the streams within it.
OPTIONS = (
    "--dtype", "fp32", "--num-kv-pages", "256", "--max-model-len", "2048", "--max-num-seqs", "8",
    "--shutdown-timeout", "2", "--max-restarts", "0",
)  # fmt: skip
STREAMS = 3
GONE_S = 20.0  # a rank notices a dead peer within its peer timeout (5 s); the drain takes 2 s


def ipc_dirs(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("tp-runtime-*"))


def bind_again(port: int) -> None:
    """Raises OSError unless the port can be listened on now, with uvicorn's SO_REUSEADDR."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
        probe.listen()


@pytest.mark.parametrize("target", [LAUNCHER, "rank0", "rank1", FRONTEND])
def test_kill_9_ends_the_group_fails_the_streams_and_frees_the_ipc_dir_and_port(
    target: str, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the frontend makes its ipc directory here
    options = ServerOptions(model=str(tiny_model), tensor_parallel_size=2, extra_args=OPTIONS)
    with RuntimeServer(options, log_path=tmp_path / "server.log") as server:
        assert len(ipc_dirs(tmp_path)) == 1, ipc_dirs(tmp_path)
        model = served_model(server.url)
        requests = [CompletionRequest(prompt_ids=(5 + i, 6, 7), max_tokens=1500, ignore_eos=True) for i in range(STREAMS)]
        streams = BackgroundStreams(server.url, model, requests, timeout_s=60).start()
        assert streams.wait_streaming(min_tokens=2, timeout_s=60), "the streams never started"
        group = server.survivors()
        assert {ref.label for ref in group} >= {LAUNCHER, FRONTEND, "rank0", "rank1"}, group
        server.signal(target, signal.SIGKILL)
        results = streams.join(timeout_s=30)
        left = server.wait_gone(GONE_S)
        assert not left, f"after kill -9 of {target}: {server.left_report(left)}"
        for result in results:
            assert result.error is not None and not result.completed, (target, result.finish_reason, len(result.token_ids))
            if target != FRONTEND:  # the HTTP server lived on: the error came as an event, then [DONE]
                assert not result.error.startswith("transport"), (target, result.error)
                assert result.done_markers == 1, (target, result.error)
        assert ipc_dirs(tmp_path) == [], f"left behind after kill -9 of {target}: {ipc_dirs(tmp_path)}"
        bind_again(server.port)
