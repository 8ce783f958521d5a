"""Strangers without the key on the frame socket of a live TP=2 server (connect-and-close, bytes that
are no ZMTP, garbage, frames signed with a guessed key, forged HELLOs for rank 0 and 1, squatters on
the identities `rank-0` and `rank-1`, a flood): every one is ignored, /metrics counts each exactly
as it must, and the greedy streams that run meanwhile all complete with the tokens they gave before.
The short form; `scripts/stress.py` runs the long one."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scripts.harness.client import (
    CompletionRequest,
    StreamResult,
    served_model,
    stream_completion,
)
from scripts.harness.metrics import (
    M_ABORTS,
    M_FRAME_CONNECTIONS,
    M_FRAME_HANDSHAKE_FAILURES,
    M_FRAME_RANK_DISCONNECTS,
    M_FRAME_UNAUTHENTICATED,
    M_FRAME_UNBOUND_DISCONNECTS,
    M_FRAME_UNBOUND_FRAMES,
    M_REQUEST_ERRORS,
)
from scripts.harness.runtime import RuntimeServer, ServerOptions
from scripts.harness.strangers import KINDS, StrangerAct, Strangers, stranger_acts

PROMPTS = [tuple(range(10 + i, 30 + i)) for i in range(3)]
MAX_TOKENS = 40

pytestmark = pytest.mark.timeout(300)


def greedy(url: str, model: str, prompt: tuple[int, ...]) -> StreamResult:
    async def one() -> StreamResult:
        async with httpx.AsyncClient(timeout=None) as client:
            request = CompletionRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
            return await stream_completion(client, url, model, request, timeout_s=60)

    return asyncio.run(one())


def counters(server: RuntimeServer) -> dict[str, float]:
    values = server.metrics()
    assert values is not None, "no /metrics"
    return values


def test_strangers_are_ignored_counted_and_fail_no_request(tiny_model: Path, tmp_path: Path) -> None:
    options = ServerOptions(
        tensor_parallel_size=2, model=str(tiny_model), dtype="fp32", num_kv_pages=128, max_model_len=256,
        max_num_seqs=8, max_num_batched_tokens=256,
    )  # fmt: skip
    with RuntimeServer(options, tmp_path / "server.log") as server:
        address = server.frame_address()
        model = served_model(server.url)
        reference = {prompt: greedy(server.url, model, prompt).token_ids for prompt in PROMPTS}
        assert all(len(tokens) == MAX_TOKENS for tokens in reference.values())
        before = counters(server)
        assert before[M_FRAME_CONNECTIONS] == 2 and before[M_FRAME_RANK_DISCONNECTS] == 0  # the two ranks

        results: list[tuple[tuple[int, ...], StreamResult]] = []
        health: list[int | None] = []
        stop = threading.Event()

        def keep_streaming() -> None:
            while not stop.is_set():
                for prompt in PROMPTS:
                    results.append((prompt, greedy(server.url, model, prompt)))
                    health.append(server.health())

        streamer = threading.Thread(target=keep_streaming, daemon=True)
        streamer.start()
        strangers = Strangers(address)
        # Every kind as `rank-1`, as `rank-0` and as nobody, then random sequences of them.
        for kind in KINDS:
            strangers.perform(StrangerAct(kind, 2000 if kind == "flood" else 12, b"rank-1", seed=1))
            strangers.perform(StrangerAct(kind, 5, b"rank-0", seed=2))
            strangers.perform(StrangerAct(kind, 3, None, seed=3))

        @settings(max_examples=6, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(acts=st.lists(stranger_acts(max_count=20, flood=1000), min_size=1, max_size=3))
        def some(acts: list[StrangerAct]) -> None:
            for act in acts:
                strangers.perform(act)

        some()
        deadline = time.monotonic() + 60
        while len(results) < 2 * len(PROMPTS) and time.monotonic() < deadline:
            time.sleep(0.1)  # at least two rounds of streams ran beside the strangers
        stop.set()
        streamer.join(timeout=120)

        total = strangers.total

        def grown(name: str) -> float:
            return counters(server)[name] - before[name]

        deadline = time.monotonic() + 10
        while (grown(M_FRAME_UNBOUND_DISCONNECTS), grown(M_FRAME_UNAUTHENTICATED)) != (total.connections, total.unauthenticated_frames):
            assert time.monotonic() < deadline, f"counted {grown(M_FRAME_UNBOUND_DISCONNECTS)} closes and {grown(M_FRAME_UNAUTHENTICATED)} frames, sent {total}"
            time.sleep(0.2)
        assert grown(M_FRAME_CONNECTIONS) == total.connections
        assert total.handshake_failures_min <= grown(M_FRAME_HANDSHAKE_FAILURES) <= total.handshake_failures_max
        assert grown(M_FRAME_UNBOUND_FRAMES) == 0 and grown(M_FRAME_RANK_DISCONNECTS) == 0
        assert total.unauthenticated_frames > 2000 and total.connections > 20

        assert len(results) >= 2 * len(PROMPTS), "the streams did not run beside the strangers"
        for prompt, result in results:
            assert result.completed and result.error is None, result.error
            assert result.token_ids == reference[prompt], "a stream's tokens changed while strangers knocked"
        assert set(health) == {200}, health
        after = counters(server)
        assert after[M_ABORTS] == before[M_ABORTS] == 0 and after.get(M_REQUEST_ERRORS, 0) == 0
