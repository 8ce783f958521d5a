"""Recovery under `tp-runtime serve` at TP=2: the executor group is restarted, the HTTP server is not.

On one server, in turn: kill -9 of rank 1 mid-stream, then of rank 0, then SIGSTOP of rank 1. Each
time the stream in flight ends with an error event naming the rank (and its [DONE]), /health turns
503, a request sent meanwhile waits and then gets the same greedy tokens as before the fault, from
the same HTTP server process (scripts/harness/recovery.py). Then: the poison proof after a recovery,
and a crash loop that ends the service with every death named and nothing left running.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx

from scripts.harness.client import CompletionRequest, served_model
from scripts.harness.metrics import labelled_value, read_metrics
from scripts.harness.processes import ProcessRef, descendants
from scripts.harness.recovery import complete, recover_from
from scripts.harness.runtime import RuntimeServer, ServerOptions, process_label
from tests.e2e.serving import SERVER_OPTIONS, Server

OPTIONS = ("--dtype", "fp32", "--num-kv-pages", "256", "--max-model-len", "2048", "--max-num-seqs", "8")
REFERENCE = CompletionRequest(prompt_ids=(11, 12, 13, 14), max_tokens=12, ignore_eos=True)
FAULTS = ((1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGSTOP))
POISON = ("--debug-poison-kv-cache", "--debug-poison-freed-pages")


def test_the_same_server_recovers_from_a_killed_and_a_stopped_rank(tiny_model: Path, tmp_path: Path) -> None:
    options = ServerOptions(model=str(tiny_model), tensor_parallel_size=2, extra_args=OPTIONS)
    with RuntimeServer(options, log_path=tmp_path / "server.log", env={"TMPDIR": str(tmp_path)}) as server:
        model = served_model(server.url)
        expected = complete(server.url, model, REFERENCE)
        assert expected.completed and len(expected.token_ids) == REFERENCE.max_tokens, expected
        for rank, sig in FAULTS:
            report = recover_from(server, rank, sig, REFERENCE, expected.token_ids)
            assert report.passed, f"{report}\n{server.log_tail()}"
            assert report.error is not None and f"rank {rank}" in report.error, report.error
            if sig == signal.SIGSTOP:
                assert "stopped answering" in report.error, report.error
            else:  # the rank that died is named, not its peer whose collective failed under it
                assert f"connection of rank {rank}" in report.error, report.error
            assert report.done_markers == 1, report
            assert report.unhealthy_s is not None and report.unhealthy_s < 10, report
        metrics = read_metrics(server.url) or {}
        assert metrics.get("tp_runtime_executor_restarts_total") == len(FAULTS), metrics
        assert metrics.get("tp_runtime_recovery_seconds_count") == len(FAULTS), metrics
        assert labelled_value(server.url, "tp_runtime_request_errors_total", fault="rank_failure") >= len(FAULTS)
        # One private directory (the bootstrap socket and the live group's frame socket) all along.
        assert len(list(tmp_path.glob("tp-runtime-*"))) == 1, list(tmp_path.glob("tp-runtime-*"))
    assert list(tmp_path.glob("tp-runtime-*")) == []


def greedy(server: Server, prompt: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=240)


def test_the_poison_proof_holds_after_a_recovery(tiny_model: Path, server_tp2: Server) -> None:
    """Poisoned cache and freed pages, clears on, a small pool: after kill -9 of rank 1 the new
    group's output (two rounds, the second on freed pages) equals an unpoisoned server's."""
    options = (*SERVER_OPTIONS[:2], "--num-kv-pages", "24", *SERVER_OPTIONS[4:], *POISON)
    prompts = ("The quick brown fox", "The quick brown fox jumps over", "Hello", "1, 2, 3, 4, 5, 6, 7, 8,")
    poisoned = Server(tiny_model, tp=2, extra=options)
    try:
        assert greedy(poisoned, prompts[0]).status_code == 200  # the first group filled the prefix cache
        poisoned.signal(1, signal.SIGKILL)
        poisoned.wait_health(lambda status: status != 200, timeout_s=15)
        for _round in range(2):
            for prompt in prompts:
                clean, dirty = greedy(server_tp2, prompt), greedy(poisoned, prompt)
                assert clean.status_code == dirty.status_code == 200, dirty.text
                assert dirty.json()["choices"][0]["text"] == clean.json()["choices"][0]["text"], prompt
        metrics = read_metrics(poisoned.url) or {}
        assert metrics.get("tp_runtime_executor_restarts_total") == 1, metrics
    finally:
        poisoned.stop()


def _kill_every_rank(root: int, rank: int, stop: threading.Event, killed: list[int]) -> None:
    """SIGKILLs each process of `rank` below `root` as soon as it appears: a rank that dies at
    every start."""
    while not stop.is_set():
        for pid in descendants(root):
            if pid not in killed and process_label(pid) == f"rank{rank}":
                ref = ProcessRef.of(pid)
                if ref is not None and ref.signal(signal.SIGKILL):
                    killed.append(pid)
        stop.wait(0.05)


def test_a_crash_loop_ends_the_service_naming_each_death(tiny_model: Path, tmp_path: Path) -> None:
    extra = (*SERVER_OPTIONS, "--max-restarts", "2", "--restart-window", "600")
    options = ServerOptions(model=str(tiny_model), tensor_parallel_size=2, extra_args=extra)
    with RuntimeServer(options, log_path=tmp_path / "server.log", env={"TMPDIR": str(tmp_path)}) as server:
        stop, killed = threading.Event(), []
        killer = threading.Thread(target=_kill_every_rank, args=(server.pid, 1, stop, killed), daemon=True)
        killer.start()
        try:
            code = server.process.wait(timeout=240)
        finally:
            stop.set()
            killer.join()
        log = server.log_tail(200)
        assert code != 0, log
        assert "the executor group died 3 times within 600 s" in log, log
        assert "rank 1 was killed by SIGKILL" in log, log
        assert len(killed) >= 3, killed
        left = server.wait_gone(10)
        assert not left, server.left_report(left)
    assert list(tmp_path.glob("tp-runtime-*")) == []
