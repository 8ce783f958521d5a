"""One fault against a server that restarts its executor group (`tp-runtime serve`'s default), as a
client sees it: the stream in flight must end with an error naming the rank, /health must turn 503,
a request sent meanwhile must wait in the queue and then get its greedy tokens from the new group,
and the HTTP server must be the same process throughout.

`recover_from(server, target, signal, reference, expected)` signals one rank while a long stream
runs, and returns a `RecoveryReport` with the times the issue's numbers are made of, each from the
signal: to the stream's error (`error_s`), to /health's 503 (`unhealthy_s`), to the first token of
the held reference request (`first_token_s`, the fault-to-first-good-token time) and to /health's
200 again (`healthy_s`). tests/e2e/test_recovery.py asserts them; scripts/bench_recovery.py takes
their medians.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field

import httpx

from scripts.harness.client import BackgroundStreams, CompletionRequest, StreamResult, served_model, stream_completion
from scripts.harness.runtime import FRONTEND, RuntimeServer

STREAM_TOKENS = 1500  # far more than the stream makes before the fault is noticed
IN_FLIGHT = CompletionRequest(prompt_ids=(5, 6, 7), max_tokens=STREAM_TOKENS, ignore_eos=True)
NOTICE_TIMEOUT_S = 15.0  # /health must leave 200 within this (a stopped rank: its silence, 1.5 s)
RECOVERY_TIMEOUT_S = 240.0  # a new group must serve within this (a loaded 2-core machine)


@dataclass
class RecoveryReport:
    fault: str
    error: str | None = None  # what the in-flight stream ended with
    done_markers: int = 0
    error_s: float | None = None
    unhealthy_s: float | None = None
    first_token_s: float | None = None
    healthy_s: float | None = None
    same_frontend: bool = False
    reference_equal: bool = False
    lost: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.lost


def complete(url: str, model: str, request: CompletionRequest, timeout_s: float = 120.0) -> StreamResult:
    """One streaming completion, to its end."""

    async def run() -> StreamResult:
        async with httpx.AsyncClient(timeout=None) as client:
            return await stream_completion(client, url, model, request, timeout_s)

    return asyncio.run(run())


def _since(t0: float, t: float | None) -> float | None:
    return None if t is None else round(t - t0, 3)


def recover_from(
    server: RuntimeServer, target: str | int, sig: signal.Signals, reference: CompletionRequest, expected: list[int]
) -> RecoveryReport:
    """Signals `target` (a rank) while a stream runs and follows the service back; `expected` is
    the reference request's greedy tokens before the fault."""
    report = RecoveryReport(f"{sig.name} {target if isinstance(target, str) else f'rank{target}'}")
    model = served_model(server.url)
    frontend = server.process_of(FRONTEND)
    inflight = BackgroundStreams(server.url, model, [IN_FLIGHT], timeout_s=RECOVERY_TIMEOUT_S).start()
    if not inflight.wait_streaming(min_tokens=2, timeout_s=60):
        report.lost.append("the stream in flight never started")
    t0 = time.perf_counter()
    server.signal(target, sig)
    try:
        server.wait_health(lambda status: status != 200, timeout_s=NOTICE_TIMEOUT_S)
        report.unhealthy_s = _since(t0, time.perf_counter())
    except TimeoutError as exc:
        report.lost.append(f"/health stayed 200: {exc}")
    # Sent once the fault is known: it must wait in the queue and be served by the new group.
    held = BackgroundStreams(server.url, model, [reference], timeout_s=RECOVERY_TIMEOUT_S).start()
    [stream] = inflight.join(timeout_s=RECOVERY_TIMEOUT_S)
    report.error, report.done_markers, report.error_s = stream.error, stream.done_markers, _since(t0, stream.t_end)
    if stream.completed or stream.error is None:
        report.lost.append(f"the stream in flight did not end with an error ({stream.finish_reason})")
    [answer] = held.join(timeout_s=RECOVERY_TIMEOUT_S + 30)
    report.first_token_s = _since(t0, answer.t_first)
    report.reference_equal = answer.completed and answer.token_ids == expected
    if not report.reference_equal:
        report.lost.append(f"the held request got {answer.token_ids} ({answer.error}), not {expected}")
    try:
        server.wait_health(lambda status: status == 200, timeout_s=30)
        report.healthy_s = _since(t0, time.perf_counter())
        server.wait_new_ranks(timeout_s=30)
    except TimeoutError as exc:
        report.lost.append(f"not healthy again: {exc}")
    report.same_frontend = frontend.alive() and server.process_of(FRONTEND).pid == frontend.pid
    if not report.same_frontend:
        report.lost.append("the HTTP server is not the process it was before the fault")
    return report
