"""What a client of the runtime sees over plain OpenAI-compatible HTTP: streaming completions
and /health.

Nothing here knows tp-runtime's internals, so that `--url` can point the same code at any other
server; a stream is followed to its end, its error, its timeout or its planned cancellation.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx


class ProtocolViolation(RuntimeError):
    """The server answered something an OpenAI-compatible stream may not contain."""


@dataclass(frozen=True)
class CompletionRequest:
    """One /v1/completions call: a token-id prompt, its sampling, and when the client hangs up."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # the alternatives each token comes back with (completions' logprobs)
    ignore_eos: bool = False
    cancel_after_tokens: int | None = None  # close the stream after this many tokens
    cancel_after_s: float | None = None  # or this long after sending, whatever has arrived by then

    def body(self, model: str) -> dict[str, object]:
        body: dict[str, object] = {
            "model": model,
            "prompt": list(self.prompt_ids),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        if self.logprobs is not None:
            body["logprobs"] = self.logprobs
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


@dataclass
class StreamResult:
    """What the client saw of one streaming completion, with client-side times (perf_counter)."""

    response_ids: set[str] = field(default_factory=set)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None  # the server's stated reason, or the transport failure
    http_status: int | None = None
    cancelled: bool = False  # the client closed the stream on purpose
    done_markers: int = 0  # `data: [DONE]` lines
    after_finish: int = 0  # chunks with text or tokens after the one that carried finish_reason
    completion_tokens: int | None = None  # from the usage chunk
    t_sent: float = 0.0
    t_first: float | None = None
    t_last: float | None = None
    t_end: float | None = None
    token_times: list[float] = field(default_factory=list)  # a piece's tokens (or its text) share its arrival

    @property
    def completed(self) -> bool:
        return self.finish_reason in ("length", "stop") and self.error is None and not self.cancelled

    @property
    def output_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids else (self.completion_tokens or self.chunks)

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_sent

    @property
    def tpot_s(self) -> float | None:
        n = self.output_tokens
        if self.t_first is None or self.t_last is None or n < 2:
            return None
        return (self.t_last - self.t_first) / (n - 1)

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latency as vLLM's benchmark reads it: for each piece after the first, the
        time since the piece before it (a piece of several tokens is one gap)."""
        arrivals = sorted(set(self.token_times))
        return [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    request: CompletionRequest,
    timeout_s: float,
    result: StreamResult | None = None,
) -> StreamResult:
    """Runs one streaming completion to its end, its error, its timeout or its planned cancellation.
    `result`, when given, is filled as the stream goes (another thread may watch it grow)."""
    result = result if result is not None else StreamResult()
    result.t_sent = time.perf_counter()
    hang_up = request.cancel_after_s is not None and request.cancel_after_s < timeout_s
    try:
        await asyncio.wait_for(_consume(client, url, model, request, result), request.cancel_after_s if hang_up else timeout_s)
    except asyncio.TimeoutError:
        if hang_up:
            result.cancelled = True  # leaving wait_for closed the connection, queued or mid-stream
        else:
            result.error = f"lost: no end of stream within {timeout_s:.0f} s"
    except httpx.HTTPError as exc:
        result.error = f"transport: {type(exc).__name__}: {exc}"
    result.t_end = time.perf_counter()
    return result


async def _consume(
    client: httpx.AsyncClient, url: str, model: str, request: CompletionRequest, result: StreamResult
) -> None:
    async with client.stream("POST", f"{url}/v1/completions", json=request.body(model)) as response:
        result.http_status = response.status_code
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            result.error = f"HTTP {response.status_code}: {_error_message(body)}"
            return
        errored = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                result.done_markers += 1
                continue
            if errored:  # after an error event only its [DONE] may come
                result.after_finish += 1
                continue
            errored = _absorb_chunk(json.loads(payload), result, time.perf_counter())
            if errored:
                continue
            cancel_at = request.cancel_after_tokens
            if cancel_at is not None and result.finish_reason is None and len(result.token_ids) >= cancel_at:
                result.cancelled = True
                return  # leaving the context closes the connection mid-stream


def _absorb_chunk(chunk: dict, result: StreamResult, now: float) -> bool:
    """Folds one SSE data object into result; True when it was an error event (only [DONE] may follow)."""
    if "error" in chunk:
        error = chunk["error"]
        result.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
        return True
    if "id" in chunk:
        result.response_ids.add(str(chunk["id"]))
    usage = chunk.get("usage")
    if usage:
        result.completion_tokens = int(usage.get("completion_tokens", 0))
    for choice in chunk.get("choices", ()):
        tokens = [int(t) for t in choice.get("token_ids") or ()]
        text = choice.get("text") or ""
        if tokens or text:
            if result.finish_reason is not None:
                result.after_finish += 1
            result.chunks += 1
            result.token_ids.extend(tokens)
            result.text += text
            result.token_times.extend([now] * max(1, len(tokens)))
            if result.t_first is None:
                result.t_first = now
            result.t_last = now
        if choice.get("finish_reason") is not None:
            if result.finish_reason is not None:
                result.after_finish += 1
            result.finish_reason = str(choice["finish_reason"])
    return False


def _error_message(body: str) -> str:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:300]
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return body.strip()[:300]


class BackgroundStreams:
    """Streaming completions on a thread of their own (with its own event loop), all at once, for a
    caller that signals processes while they run: `start()`, `wait_streaming()` until each has
    tokens (or has ended), then `join()` for the results. A context manager that joins."""

    def __init__(self, url: str, model: str, requests: Sequence[CompletionRequest], timeout_s: float) -> None:
        self.url = url
        self.model = model
        self.requests = list(requests)
        self.timeout_s = timeout_s
        self.results = [StreamResult() for _ in self.requests]
        self._ended = [False] * len(self.requests)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="streams", daemon=True)

    def __enter__(self) -> BackgroundStreams:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.join()

    def start(self) -> BackgroundStreams:
        self._thread.start()
        return self

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=len(self.requests) + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:

            async def one(i: int) -> None:
                try:
                    await stream_completion(client, self.url, self.model, self.requests[i], self.timeout_s, self.results[i])
                finally:
                    self._ended[i] = True

            await asyncio.gather(*(one(i) for i in range(len(self.requests))))

    def streaming(self, min_tokens: int = 1) -> bool:
        """Whether every stream has at least min_tokens tokens or has ended."""
        return all(ended or len(r.token_ids) >= min_tokens for r, ended in zip(self.results, self._ended))

    def wait_streaming(self, min_tokens: int = 1, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.streaming(min_tokens):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def done(self) -> bool:
        return all(self._ended)

    def join(self, timeout_s: float | None = None) -> list[StreamResult]:
        """The results once every stream ended; raises TimeoutError if one still runs."""
        self._thread.join(timeout=self.timeout_s + 30 if timeout_s is None else timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"{self._ended.count(False)} of {len(self.requests)} streams still run")
        return self.results


def served_model(url: str) -> str:
    """The id that /v1/models lists first: requests must name it."""
    response = httpx.get(f"{url}/v1/models", timeout=10.0)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ProtocolViolation(f"{url}/v1/models lists no model")
    return str(models[0]["id"])


def health_status(url: str, timeout_s: float = 1.0) -> int | None:
    """The status code of GET /health; None when nothing answers."""
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code
    except httpx.HTTPError:
        return None


@dataclass(frozen=True)
class HealthChange:
    status: int | None  # the status that ended the wait; None: nothing answered
    after_s: float  # since the wait began


def wait_for_health(
    url: str, until: Callable[[int | None], bool], timeout_s: float, interval_s: float = 0.05
) -> HealthChange:
    """Polls /health until `until(status)` holds, e.g. `lambda s: s != 200` after a rank was stopped.

    Raises TimeoutError, naming the last status seen, when it does not hold within timeout_s.
    """
    started = time.monotonic()
    while True:
        status = health_status(url)
        elapsed = time.monotonic() - started
        if until(status):
            return HealthChange(status, elapsed)
        if elapsed >= timeout_s:
            raise TimeoutError(f"/health at {url} still answered {status} after {timeout_s:.1f} s")
        time.sleep(interval_s)
