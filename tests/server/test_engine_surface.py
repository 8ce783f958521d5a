"""What the HTTP side reads of the real Engine: published stats snapshots (never live scheduler
state), the bound on requests in flight, and the last event of a stream the runtime ends early."""

from __future__ import annotations

import json
import threading
import time

import pytest
from server.fake_rank import running_engine

from protocol.conversation import SchedulerConversation
from protocol.frames import Continue, Prepare
from scheduler.request import SamplingParams
from scheduler.scheduler import Scheduler
from tp_runtime.engine import EngineOverloaded, EngineStats
from tp_runtime.stats import STEP_LATENCY_BUCKETS


def drain_all(streams) -> None:
    for stream in streams:
        for _ in stream:
            pass


def settled(engine, finished: int) -> EngineStats:
    """The first snapshot published after `finished` requests have ended."""
    deadline = time.monotonic() + 10
    while (stats := engine.stats()).requests_finished_total < finished or stats.scheduler.running:
        assert time.monotonic() < deadline, f"the engine never published a snapshot with {finished} finished"
        time.sleep(0.01)
    return stats


def test_stats_are_snapshots_the_engine_thread_made(monkeypatch):
    # Scheduler.stats() walks the waiting deque; called from the HTTP thread while the engine
    # thread changes it, it raised "deque mutated during iteration" under load.
    callers: list[str] = []
    real_stats = Scheduler.stats

    def recording_stats(self):
        callers.append(threading.current_thread().name)
        return real_stats(self)

    monkeypatch.setattr(Scheduler, "stats", recording_stats)
    seen: list[EngineStats] = []
    stop = threading.Event()

    with running_engine() as engine:

        def read() -> None:
            while not stop.is_set():
                seen.append(engine.stats())

        reader = threading.Thread(target=read, name="http-reader")
        reader.start()
        try:
            streams = [engine.submit([1, 2, 3, i], SamplingParams(max_tokens=6)) for i in range(12)]
            drain_all(streams)
            final = settled(engine, 12)
        finally:
            stop.set()
            reader.join()
    assert "http-reader" not in callers and threading.current_thread().name not in callers[1:]
    assert set(callers[1:]) == {"engine-loop"}
    assert final.tokens_generated_total == 72 and final.requests_finished_total == 12
    assert final.prompt_tokens_total == 48 and final.scheduler.running == 0
    totals = [s.tokens_generated_total for s in seen]
    assert totals == sorted(totals), "a snapshot went back in time"


def test_step_latencies_are_bucket_counts_that_do_not_grow():
    with running_engine() as engine:
        drain_all([engine.submit([1, 2, 3], SamplingParams(max_tokens=20))])
        stats = settled(engine, 1)
    latency = stats.step_latency
    assert latency.bounds == STEP_LATENCY_BUCKETS and len(latency.counts) == len(STEP_LATENCY_BUCKETS) + 1
    assert latency.count == stats.scheduler.steps_total >= 20
    assert 0 < latency.total <= stats.step_time_s_total + 1e-9


def test_submit_past_the_bound_is_overloaded_until_one_ends():
    with running_engine(step_delay_s=0.01, max_num_queued_reqs=3) as engine:
        held = [engine.submit([1, 2], SamplingParams(max_tokens=30)) for _ in range(3)]
        with pytest.raises(EngineOverloaded, match="3 requests are in flight") as refused:
            engine.submit([1, 2], SamplingParams(max_tokens=2))
        assert refused.value.retry_after_s > 0
        drain_all(held[:1])
        deadline = time.monotonic() + 5
        while True:
            try:
                extra = engine.submit([1, 2], SamplingParams(max_tokens=2))
                break
            except EngineOverloaded:
                assert time.monotonic() < deadline, "the bound did not free a slot when a request ended"
                time.sleep(0.01)
        drain_all([*held[1:], extra])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_a_stream_the_runtime_ends_gets_its_last_event(tokenizer, path):
    """A shutdown (drain timeout, rank failure) fails the streams in flight: each client gets an
    error event (and [DONE] on the OpenAI routes), never a silently cut stream."""
    from fastapi.testclient import TestClient

    from tp_runtime.http import ServerSettings, create_app

    bodies = {
        "/v1/completions": {"prompt": "tell me", "max_tokens": 200, "stream": True},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True},
        "/generate": {"text": "tell me", "sampling_params": {"max_completion_tokens": 200}, "stream": True},
    }
    word = tokenizer.encode(" word")[0]
    with running_engine(token=word, step_delay_s=0.01) as engine:
        app = create_app(engine, tokenizer, ServerSettings(("fake",)))
        timer = threading.Timer(0.3, engine.shutdown, args=("the runtime is shutting down",))
        timer.start()
        with TestClient(app) as client:
            text = client.post(path, json=bodies[path]).text
        timer.join()
    events = [block for block in text.split("\n\n") if block]
    assert len(events) > 3, "the stream ended before the shutdown"
    if path == "/generate":
        assert events[-1].startswith("event: error\ndata: ")
        error = json.loads(events[-1].split("data: ", 1)[1])
    else:
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: ") :])
    assert "shutting down" in error["error"]["message"]
    assert error["error"]["code"] == "engine_unavailable"


def test_a_steady_stream_is_sent_as_continues_and_loses_no_token(monkeypatch):
    sent: list[type] = []
    real_prepare = SchedulerConversation.prepare

    def recording_prepare(self, step, body, brief=None):
        out = real_prepare(self, step, body, brief)
        sent.append(type(out.body))
        return out

    monkeypatch.setattr(SchedulerConversation, "prepare", recording_prepare)
    with running_engine(token=9, step_delay_s=0.002, max_inflight_steps=2) as engine:
        events = list(engine.submit([1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True)))
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == [9] * 30 and events[-1].finish_reason == "length"
    # The prefill and the first decode (nothing held yet to continue, or no sample to feed back)
    # go whole; the steady decode after them as CONTINUE.
    assert sent[0] is Prepare and sent.count(Continue) >= 25, sent
