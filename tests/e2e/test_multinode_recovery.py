"""Recovery across hosts: two "hosts" on this machine (`--nnodes 2`, one rank each, TP=2, the
operator's key directories, a fixed --frame-port), as tests/e2e/test_multinode.py runs them.

On one two-host server, in turn: kill -9 of the rank on host 1 mid-stream, then of the rank on host
0 (the frontend's). Each time the stream in flight ends with an error naming the rank, /health turns
503, and the same HTTP server (same pid) answers the held reference request with the same greedy
tokens as before the fault, from a group whose ranks rejoined through the c10d rendezvous. Then a
crash loop: a rank on host 1 that dies at every start ends the service on both hosts, and nothing of
either is left running.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest

from scripts.harness.client import CompletionRequest, served_model
from scripts.harness.metrics import read_metrics
from scripts.harness.processes import ProcessRef, descendants
from scripts.harness.recovery import complete, recover_from
from scripts.harness.runtime import ServerOptions, process_label
from scripts.harness.two_hosts import TwoHostServer
from tests.e2e.serving import SERVER_OPTIONS
from tp_runtime.frame_keys import create_key_dirs

# A context long enough for the stream in flight (scripts/harness/recovery.py), as tests/e2e/test_recovery.py.
OPTIONS = ("--dtype", "fp32", "--num-kv-pages", "256", "--max-model-len", "2048", "--max-num-seqs", "8")
REFERENCE = CompletionRequest(prompt_ids=(11, 12, 13, 14), max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def key_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    dirs = create_key_dirs(str(tmp_path_factory.mktemp("keys") / "out"), ["host0", "host1"])
    return str(dirs["host0"]), str(dirs["host1"])


def test_two_hosts_recover_from_a_killed_rank_on_either_host(
    tiny_model: Path, key_dirs: tuple[str, str], tmp_path: Path
) -> None:
    options = ServerOptions(model=str(tiny_model), tensor_parallel_size=2, extra_args=OPTIONS)
    with TwoHostServer(options, key_dirs, tmp_path) as server:
        frontend_pid = server.process_of("frontend").pid
        assert frontend_pid in descendants(server.pid), "the frontend runs on node 0"
        expected = complete(server.url, served_model(server.url), REFERENCE)
        assert expected.completed and len(expected.token_ids) == REFERENCE.max_tokens, expected
        for host in (1, 0):
            rank = next(r for r in range(2) if server.host_of(r) == host)
            report = recover_from(server, rank, signal.SIGKILL, REFERENCE, expected.token_ids)
            print(f"host {host}: {report}")  # the times, for docs/reports.md
            assert report.passed, f"{report}\n{server.log_tail(80)}"
            assert report.error is not None and f"rank {rank}" in report.error, report.error
            assert report.unhealthy_s is not None and report.unhealthy_s < 10, report
            assert server.process_of("frontend").pid == frontend_pid
        metrics = read_metrics(server.url) or {}
        assert metrics.get("tp_runtime_executor_restarts_total") == 2, metrics


def _kill_every_start(server: TwoHostServer, stop: threading.Event, killed: list[int]) -> None:
    """SIGKILLs each rank process on host 1 as soon as it appears: a rank that dies at every start."""
    assert server.other is not None
    while not stop.is_set():
        for pid in descendants(server.other.pid):
            if pid not in killed and (process_label(pid) or "").startswith("rank"):
                ref = ProcessRef.of(pid)
                if ref is not None and ref.signal(signal.SIGKILL):
                    killed.append(pid)
        stop.wait(0.05)


def test_a_crash_loop_across_hosts_ends_the_service_on_every_host(
    tiny_model: Path, key_dirs: tuple[str, str], tmp_path: Path
) -> None:
    extra = (*SERVER_OPTIONS, "--max-restarts", "1", "--restart-window", "600")
    options = ServerOptions(model=str(tiny_model), tensor_parallel_size=2, extra_args=extra)
    with TwoHostServer(options, key_dirs, tmp_path) as server:
        assert server.process is not None and server.other is not None
        stop, killed = threading.Event(), []
        killer = threading.Thread(target=_kill_every_start, args=(server, stop, killed), daemon=True)
        killer.start()
        try:
            codes = (server.process.wait(timeout=240), server.other.wait(timeout=60))
        finally:
            stop.set()
            killer.join()
        log = server.log_tail(200)
        assert codes[0] != 0 and codes[1] != 0, (codes, log)
        assert "the executor group died 2 times within 600 s" in log, log
        assert "the service ended on node 0" in log, log
        left = server.wait_gone(10)
        assert not left, server.left_report(left)
