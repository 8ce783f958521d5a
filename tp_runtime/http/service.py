"""The path every generating route shares: from a validated body to its tokens, its Generation,
and its answer (whole, or as a stream that always ends properly).

Routes parse their body, turn it into a prompt and a SamplingRequest, and format pieces; the rest is
here, once: the prompt cap and tokenizing off the event loop, validation, submit and its refusals,
collecting the whole output while watching for a client that hangs up, and a stream whose failure is
one last error event rather than a cut connection.

A request for n choices is n engine requests: the first leads, the others name it as their prompt
leader and share its prompt's KV pages (prefix snapshots: references, not copies), each with its
own seed (validation.sample_seed). Their pieces are read together, in the order they come; when one
fails, or the client goes, all n are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from protocol.grammar import GrammarSpec
from scheduler.request import SamplingParams
from scheduler.scheduler import AdmissionError
from tp_runtime.chat import ChatTemplateError, parse_messages
from tp_runtime.engine import EngineOverloaded, EngineUnavailable
from tp_runtime.http import structured_output, validation
from tp_runtime.http.api_models import SamplingRequest
from tp_runtime.http.errors import ADMISSION_CODE, ApiError, invalid_request, overloaded, unavailable
from tp_runtime.http.generation import Generation, GenerationFailed, Piece
from tp_runtime.http.metrics import Metrics
from tp_runtime.http.sse import EventStream
from tp_runtime.http.text import TextWorker
from tp_runtime.http.validation import Limits, Prepared
from tp_runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tp_runtime.engine import Engine


@dataclass(frozen=True)
class Collected:
    """A whole output, once generation has ended."""

    text: str
    finish_reason: str | None
    pieces: tuple[Piece, ...]


class GenerationService:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, metrics: Metrics, limits: Limits, text: TextWorker):
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.limits = limits
        self._text = text

    # ---- prompt -> token ids ----------------------------------------------------------------------

    async def encode_prompt(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        validation.check_text(text, param)
        validation.check_prompt_chars(len(text), self.limits, param)
        return await self._text.encode(text, add_special_tokens)

    async def encode_chat(
        self,
        messages: Sequence[object],
        tools: Sequence[Mapping[str, object]] = (),
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Messages (tool-call histories included) and tool definitions through the chat template."""
        try:
            parsed = parse_messages(messages)
        except ChatTemplateError as exc:
            raise invalid_request(str(exc), param="messages") from exc
        for index, message in enumerate(parsed):
            validation.check_text(message.content, f"messages.{index}.content")
            for call in message.tool_calls:
                validation.check_text(call.arguments, f"messages.{index}.tool_calls")
        chars = sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in parsed)
        validation.check_prompt_chars(chars, self.limits, "messages")
        try:
            return await self._text.encode_chat(parsed, tools, add_generation_prompt, add_special_tokens)
        except ChatTemplateError as exc:
            raise invalid_request(str(exc), param="messages") from exc

    async def check_grammar(self, asked: structured_output.Asked | None) -> GrammarSpec | None:
        """The grammar checked with the engine, off the event loop (a large schema takes a while)."""
        return None if asked is None else await self._text.run(structured_output.checked, asked)

    def check_sampling(self, sampling: SamplingRequest) -> None:
        validation.check_sampling(sampling, self.limits.vocab_size)
        validation.check_max_logprobs(sampling, self.limits.max_logprobs)

    def prepare(self, prompt_token_ids: list[int], sampling: SamplingRequest, prompt_param: str) -> Prepared:
        return validation.prepare(prompt_token_ids, sampling, self.limits, prompt_param)

    # ---- submit ---------------------------------------------------------------------------------

    def start(self, prepared: Prepared, arrival: float, logprobs: bool = False) -> list[Generation]:
        """Submit the request's n samples; if one cannot be submitted, those already are cancelled.
        logprobs: the answer lists each token's log-probability and text offset."""
        started: list[Generation] = []
        try:
            for index in range(prepared.n):
                params = prepared.params
                if index:
                    params = dataclasses.replace(params, seed=validation.sample_seed(params.seed, index))
                leader = started[0].request_id if started else None
                started.append(self._submit(prepared, params, leader, arrival, logprobs, index))
        except Exception:
            for generation in started:
                generation.abandon()
            raise
        return started

    def _submit(
        self, prepared: Prepared, params: SamplingParams, leader: int | None, arrival: float, logprobs: bool, index: int
    ) -> Generation:
        metrics = self.metrics
        try:
            stream = self.engine.submit(prepared.prompt_token_ids, params, prompt_leader=leader)
        except AdmissionError as exc:
            metrics.request_rejects.labels("admission").inc()
            raise invalid_request(str(exc), code=ADMISSION_CODE) from exc
        except EngineOverloaded as exc:
            metrics.request_rejects.labels("overloaded").inc()
            raise overloaded(str(exc), exc.retry_after_s) from exc
        except EngineUnavailable as exc:
            metrics.request_rejects.labels("unavailable").inc()
            raise unavailable(str(exc), exc.retry_after_s) from exc
        return Generation(
            self.engine, self.tokenizer, stream, prepared.prompt_token_ids, prepared.stops, metrics.timer(arrival),
            min_tokens=params.min_tokens, logprobs=logprobs, index=index,
        )

    # ---- answers --------------------------------------------------------------------------------

    async def collect(self, request: Request, generations: Sequence[Generation]) -> list[Collected] | None:
        """Every choice's whole output, or None if the client left first (all are then cancelled)."""

        async def run() -> list[Collected]:
            pieces: list[list[Piece]] = [[] for _ in generations]
            async for index, piece in pieces_of(generations):
                pieces[index].append(piece)
            return [_collected(choice) for choice in pieces]

        try:
            return await _until_done_or_disconnected(request, run(), self.metrics.request_cancels.inc)
        except GenerationFailed as exc:
            self.metrics.request_errors.labels(exc.fault).inc()
            raise exc.error from exc

    def stream(
        self, events: AsyncGenerator[str, None], error_events: Callable[[ApiError], Sequence[str]]
    ) -> EventStream:
        """Streams `events`. A failure after the stream started ends it with `error_events(error)`
        (the OpenAI routes send the error and then their `[DONE]`): a client always sees why its
        stream ended. A reader that goes away (the task is cancelled) is counted as a cancel."""

        def failure(exc: Exception) -> str | None:
            if not isinstance(exc, GenerationFailed):
                return None
            last = "".join(error_events(exc.error))  # first: if it fails, the stream counts as hung up alone
            self.metrics.request_errors.labels(exc.fault).inc()
            return last

        return EventStream(events, failure, self.metrics.request_cancels.inc)


def _collected(pieces: list[Piece]) -> Collected:
    reason = next((p.finish_reason for p in reversed(pieces) if p.finish_reason), None)
    return Collected("".join(p.text for p in pieces), reason, tuple(pieces))


_END = object()


def pieces_of(generations: Sequence[Generation]) -> AsyncIterator[tuple[int, Piece]]:
    """(choice index, piece) of every generation as each comes (the index is the generation's own,
    0 to n-1 as GenerationService.start numbers them). The first failure ends them all (the others
    are cancelled in the engine) and is raised; so does closing this iterator."""
    return generations[0].pieces() if len(generations) == 1 else _merged(generations)


async def _merged(generations: Sequence[Generation]) -> AsyncIterator[tuple[int, Piece]]:
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(generation: Generation) -> None:
        try:
            async for item in generation.pieces():
                queue.put_nowait(item)
        except GenerationFailed as exc:
            queue.put_nowait((generation.index, exc))
        else:
            queue.put_nowait((generation.index, _END))

    tasks = [asyncio.ensure_future(pump(g)) for g in generations]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, GenerationFailed):
                raise item
            else:
                yield index, item
    finally:
        # A failed or abandoned request: each generation's own clean-up cancels it in the engine.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def arrival_time() -> float:
    """When a route took a request, on the clock the request timers use."""
    return time.monotonic()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _until_done_or_disconnected(request: Request, work: Awaitable, on_disconnect: Callable[[], None]):
    """Runs `work` unless the client hangs up first; then `on_disconnect` and None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    # Let the work unwind (its finally blocks tell the engine) before answering.
    with contextlib.suppress(asyncio.CancelledError):
        await task
    on_disconnect()
    return None
