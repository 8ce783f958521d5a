"""The streaming client, /metrics parsing and process helpers, against in-test transports."""

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from scripts.harness.client import CompletionRequest, stream_completion
from scripts.harness.metrics import parse_metrics
from scripts.harness.output import percentile
from scripts.harness.processes import descendants, rss_bytes
from scripts.harness.runtime import RuntimeServer, ServerOptions, ServerStartError

URL = "http://runtime.test"


def chunk(tokens, text, finish=None, rid="cmpl-1"):
    return {"id": rid, "object": "text_completion", "choices": [{"index": 0, "text": text, "token_ids": tokens, "finish_reason": finish}]}


def sse(*objects, done=True):
    lines = [f"data: {json.dumps(o)}\n\n" for o in objects]
    return lines + (["data: [DONE]\n\n"] if done else [])


class Streamer:
    """An SSE body served line by line; records how far the client read before hanging up."""

    def __init__(self, lines, status=200):
        self.lines, self.status, self.sent, self.bodies = lines, status, 0, []

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))

        async def body():
            for line in self.lines:
                self.sent += 1
                yield line.encode()

        return httpx.Response(self.status, content=body(), headers={"content-type": "text/event-stream"})

    def run(self, request, timeout_s=10.0):
        async def go():
            async with httpx.AsyncClient(transport=httpx.MockTransport(self.handler)) as client:
                return await stream_completion(client, URL, "m", request, timeout_s)

        return asyncio.run(go())


def test_a_full_stream_collects_tokens_text_usage_and_times():
    lines = sse(chunk([5, 6], "ab"), chunk([7], "c", "length"), {"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": 3}})
    s = Streamer(lines)
    result = s.run(CompletionRequest(prompt_ids=(1, 2), max_tokens=3, seed=4, ignore_eos=True))
    assert result.token_ids == [5, 6, 7] and result.text == "abc" and result.finish_reason == "length"
    assert result.completed and result.done_markers == 1 and result.after_finish == 0
    assert result.response_ids == {"cmpl-1"} and result.completion_tokens == 3
    assert result.ttft_s is not None and result.ttft_s >= 0 and len(result.token_times) == 3
    body = s.bodies[0]
    assert body["prompt"] == [1, 2] and body["stream"] and body["return_token_ids"] and body["ignore_eos"] and body["seed"] == 4


def test_an_error_event_ends_the_stream_with_the_servers_reason():
    lines = sse(chunk([5], "a"), {"error": {"message": "the logits were not finite", "type": "server_error"}}, done=False)
    result = Streamer(lines).run(CompletionRequest(prompt_ids=(1,), max_tokens=4))
    assert not result.completed and result.error == "the logits were not finite" and result.token_ids == [5]


def test_the_client_hangs_up_after_the_planned_number_of_tokens():
    lines = sse(*(chunk([i], "x") for i in range(20)), chunk([99], "y", "length"))
    s = Streamer(lines)
    result = s.run(CompletionRequest(prompt_ids=(1,), max_tokens=21, cancel_after_tokens=3))
    assert result.cancelled and result.token_ids == [0, 1, 2] and result.finish_reason is None
    assert s.sent < len(lines), "the client must stop reading the stream"


def test_the_client_hangs_up_after_the_planned_time_even_before_the_first_token():
    async def slow(request):
        async def body():
            await asyncio.sleep(30)
            yield b"data: " + json.dumps(chunk([1], "a")).encode() + b"\n\n"

        return httpx.Response(200, content=body())

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(slow)) as client:
            request = CompletionRequest(prompt_ids=(1,), max_tokens=4, cancel_after_s=0.2)
            return await stream_completion(client, URL, "m", request, 10.0)

    result = asyncio.run(go())
    assert result.cancelled and result.error is None and result.token_ids == []
    assert 0.2 <= result.t_end - result.t_sent < 5.0
    assert "cancel_after_s" not in CompletionRequest(prompt_ids=(1,), max_tokens=4, cancel_after_s=1.0).body("m")


def test_chunks_after_the_finish_are_counted():
    lines = sse(chunk([1], "a", "stop"), chunk([2], "b"))
    assert Streamer(lines).run(CompletionRequest(prompt_ids=(1,), max_tokens=4)).after_finish == 1


def test_an_http_error_is_a_stated_failure():
    lines = [json.dumps({"error": {"message": "prompt is too long", "type": "invalid_request_error"}})]
    result = Streamer(lines, status=400).run(CompletionRequest(prompt_ids=(1,), max_tokens=4))
    assert result.error == "HTTP 400: prompt is too long" and result.http_status == 400


def test_a_stream_that_never_ends_is_lost():
    async def forever(request):
        async def body():
            yield b"data: " + json.dumps(chunk([1], "a")).encode() + b"\n\n"
            await asyncio.sleep(30)

        return httpx.Response(200, content=body())

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(forever)) as client:
            return await stream_completion(client, URL, "m", CompletionRequest(prompt_ids=(1,), max_tokens=4), 0.3)

    result = asyncio.run(go())
    assert result.error.startswith("lost:") and result.token_ids == [1]


def test_parse_metrics_reads_prometheus_text_summing_labels():
    registry = CollectorRegistry()
    Gauge("tp_runtime_kv_pages_used", "u", registry=registry).set(12)
    c = Counter("tp_runtime_http_requests", "h", ("status",), registry=registry)
    c.labels("200").inc(3)
    c.labels("400").inc(1)
    Histogram("tp_runtime_step_latency_seconds", "s", registry=registry).observe(0.2)
    values = parse_metrics(generate_latest(registry).decode())
    assert values["tp_runtime_kv_pages_used"] == 12.0
    assert values["tp_runtime_http_requests_total"] == 4.0
    assert values["tp_runtime_step_latency_seconds_count"] == 1.0
    assert not any(name.endswith("_bucket") for name in values)


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_descendants_and_rss_of_a_live_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in descendants(os.getpid())
        assert rss_bytes(child.pid) > 1 << 20
    finally:
        child.kill()
        child.wait()
    assert rss_bytes(child.pid) is None


def test_server_options_become_serve_flags():
    argv = ServerOptions(tensor_parallel_size=2, num_kv_pages=96, swap_space="6MiB", poison_kv_cache=True, poison_freed_pages=True).argv(8123)
    assert argv[:5] == ["serve", "--host", "127.0.0.1", "--port", "8123"]
    joined = " ".join(argv)
    for flag in ("--tensor-parallel-size 2", "--num-kv-pages 96", "--swap-space 6MiB", "--debug-poison-kv-cache", "--debug-poison-freed-pages"):
        assert flag in joined
    assert "--debug-skip-clears" not in joined and "--max-model-len" not in joined


def test_a_server_that_cannot_start_says_why(tmp_path):
    server = RuntimeServer(ServerOptions(page_size=3), tmp_path / "server.log")
    with pytest.raises(ServerStartError, match="exited with code 2"):
        server.start(timeout_s=120)
    assert server.process.poll() is not None
