"""The HTTP frontend: shortfin-style /generate, OpenAI-compatible completions, health and metrics.

Everything here runs on one asyncio loop in the frontend process. The engine is reached only
through `submit`, `cancel` and `finish`; tokens come back as `TokenEvent`s on a `RequestStream`.
Every error leaves as JSON `{"error": {"message", "type", "code", "param"}}` (the OpenAI shape, so
the openai client raises its typed exceptions), or, once a stream has started, as an SSE event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler.request import SamplingParams
from scheduler.scheduler import AdmissionError
from tp_runtime.api_models import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    GenerateRequest,
    ModelCard,
    ModelList,
    OpenAISampling,
    SamplingRequest,
    Usage,
)
from tp_runtime.chat import ChatTemplateError, render_chat
from tp_runtime.engine import EngineUnavailable, RequestStream
from tp_runtime.metrics import Metrics
from tp_runtime.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from tp_runtime.engine import Engine

SSE_MEDIA_TYPE = "text/event-stream"
MAX_STOP_STRINGS = 16
ADMISSION_CODE = "request_too_large"


# ---- errors ----------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered as JSON with an HTTP status; the message is shown to the client."""

    def __init__(self, status: int, message: str, *, type: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid_request(message: str, *, code: str = "invalid_request", param: str | None = None) -> ApiError:
    return ApiError(400, message, type="invalid_request_error", code=code, param=param)


def _unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="server_unavailable", code="engine_unavailable")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One sentence per pydantic error, with the field path as JSON would write it."""
    sentences = []
    first_param = None
    for error in exc.errors():
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        path = ".".join(location)
        if error.get("type") == "json_invalid":
            ctx = error.get("ctx", {})
            sentences.append(f"the request body is not valid JSON ({ctx.get('error', 'parse error')})")
            continue
        first_param = first_param or path or None
        subject = f"'{path}'" if path else "the request body"
        sentences.append(f"{subject}: {error.get('msg', 'invalid value')}")
    return "; ".join(sentences) or "the request is invalid", first_param


# ---- request bodies --------------------------------------------------------------------------------


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back any tail that could start one, so that no
    part of a stop string is ever sent before it is known to be one."""

    def __init__(self, stops: tuple[str, ...]):
        self._stops = stops
        self._text = ""
        self._sent = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text that is safe to send, whether a stop string ended the output)."""
        self._text += delta
        if not self._stops:
            out, self._sent = self._text[self._sent :], len(self._text)
            return out, False
        # Everything before _sent was checked not to start a stop string, so a match starts later.
        hits = [i for i in (self._text.find(s, self._sent) for s in self._stops) if i >= 0]
        if hits:
            end = min(hits)
            out, self._sent = self._text[self._sent : end], end
            return out, True
        safe = len(self._text) - self._open_prefix_length()
        out, self._sent = self._text[self._sent : max(safe, self._sent)], max(safe, self._sent)
        return out, False

    def flush(self) -> str:
        """The held-back tail, once the output has ended without completing a stop string."""
        out, self._sent = self._text[self._sent :], len(self._text)
        return out

    def _open_prefix_length(self) -> int:
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self._text) - self._sent), longest, -1):
                if self._text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


@dataclass(frozen=True)
class _Piece:
    """One step of a request's output as the client sees it."""

    text: str
    finish_reason: str | None  # set on the last piece: "length" or "stop"


class GenerationFailed(Exception):
    """The runtime failed the request after admission; carries the HTTP-shaped error."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


class Generation:
    """One admitted request: turns its token events into text pieces, applies stop strings, and
    makes sure the engine hears of a request that nobody reads any more."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        stream: RequestStream,
        prompt_token_ids: list[int],
        stops: tuple[str, ...],
    ):
        self.request_id = stream.request_id
        self.prompt_tokens = len(prompt_token_ids)
        self.completion_tokens = 0
        self.token_ids: list[int] = []
        self._engine = engine
        self._stream = stream
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = StopStringMatcher(stops)

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )

    async def pieces(self) -> AsyncIterator[_Piece]:
        ended = False
        try:
            async for event in self._stream:
                self.completion_tokens += len(event.token_ids)
                self.token_ids.extend(event.token_ids)
                if event.finish_reason == "error" or event.error is not None:
                    ended = True
                    raise GenerationFailed(self._failure(event.error))
                text = "".join(self._detokenizer.add(token) for token in event.token_ids)
                if event.finished:
                    text += self._detokenizer.flush()
                out, stopped = self._stops.feed(text)
                if stopped:
                    ended = True
                    self._engine.finish(self.request_id)
                    yield _Piece(out, "stop")
                    return
                if event.finished:
                    ended = True
                    if event.finish_reason not in ("length", "stop"):
                        raise GenerationFailed(
                            _unavailable(f"the runtime ended the request early ({event.finish_reason})")
                        )
                    yield _Piece(out + self._stops.flush(), event.finish_reason)
                    return
                if out:
                    yield _Piece(out, None)
            ended = True
            raise GenerationFailed(self._failure("the token stream ended without a final event"))
        except EngineUnavailable as exc:
            ended = True
            raise GenerationFailed(_unavailable(str(exc))) from exc
        finally:
            if not ended:
                # The reader went away (client disconnect, cancelled task): free the slot now.
                self._engine.cancel(self.request_id)

    def _failure(self, message: str | None) -> ApiError:
        health = self._engine.health()
        text = message or "the runtime failed this request"
        if not health.ok:
            return _unavailable(text)
        return ApiError(500, text, type="server_error", code="generation_failed")


@dataclass(frozen=True)
class _Prepared:
    """A validated request, ready to submit."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]


# ---- the app ---------------------------------------------------------------------------------------


class _RequestCounter:
    """Counts answered requests by route and status, in plain ASGI so streaming stays untouched."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: frozenset[str]):
        self._app = app
        self._metrics = metrics
        self._routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self._routes else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._metrics.http_requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self._app(scope, receive, counting_send)


_SSE_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def _sse(data: str, event: str | None = None) -> str:
    """One server-sent event; a multi-line payload becomes several data lines, as SSE requires
    (a reader joins them with "\\n", so a bare "\\r" in the text arrives as "\\n")."""
    head = f"event: {event}\n" if event else ""
    return head + "".join(f"data: {line}\n" for line in _SSE_LINE_BREAK.split(data)) + "\n"


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


def create_app(engine: Engine, tokenizer: Tokenizer, model_name: str) -> FastAPI:
    app = FastAPI(title="tp-runtime", docs_url=None, redoc_url=None)
    metrics = Metrics(engine)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        # Every 4xx is raised before the request reaches the engine; admission refusals are
        # counted where the engine raises them.
        if 400 <= exc.status < 500 and exc.code != ADMISSION_CODE:
            metrics.request_rejects.labels("invalid").inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        metrics.request_rejects.labels("invalid").inc()
        return invalid_request(message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        error = ApiError(exc.status_code, str(exc.detail), type="invalid_request_error", code=code)
        return error.response()

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(
                404,
                f"the model '{name}' does not exist here; this server serves '{model_name}'",
                type="invalid_request_error",
                code="model_not_found",
                param="model",
            )

    def prepare(prompt_token_ids: list[int], sampling: SamplingRequest) -> _Prepared:
        limit = engine.max_model_len
        max_tokens = sampling.max_tokens
        prompt_len = len(prompt_token_ids)
        if prompt_len == 0:
            raise invalid_request("the prompt is empty: it must hold at least one token", param="prompt")
        if prompt_len >= limit:
            raise invalid_request(
                f"the prompt is {prompt_len} tokens long, and this model's context is {limit} tokens: "
                "shorten the prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise invalid_request(
                f"this model's context is {limit} tokens, but {prompt_len + max_tokens} were requested "
                f"({prompt_len} in the prompt, {max_tokens} to generate): lower the max tokens",
                code="context_length_exceeded",
            )
        vocab = tokenizer.vocab_size
        bad = [t for t in (*prompt_token_ids, *sampling.stop_token_ids) if not 0 <= t < vocab]
        if bad:
            raise invalid_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        stops = sampling.stop
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise invalid_request(
                f"'stop' takes up to {MAX_STOP_STRINGS} non-empty strings", param="stop"
            )
        ends = sampling.stop_token_ids + (() if sampling.ignore_eos else tokenizer.eos_token_ids)
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=max(sampling.top_k, 0),  # -1 means "off" in vLLM's API, 0 here
                seed=sampling.seed,
                stop_token_ids=tuple(dict.fromkeys(ends)),
                ignore_eos=sampling.ignore_eos,
            )
        except ValueError as exc:
            raise invalid_request(str(exc)) from exc
        return _Prepared(list(prompt_token_ids), params, stops)

    def start(prepared: _Prepared) -> Generation:
        try:
            stream = engine.submit(prepared.prompt_token_ids, prepared.params)
        except AdmissionError as exc:
            metrics.request_rejects.labels("admission").inc()
            raise invalid_request(str(exc), code=ADMISSION_CODE) from exc
        except EngineUnavailable as exc:
            metrics.request_rejects.labels("unavailable").inc()
            raise _unavailable(str(exc)) from exc
        except ValueError as exc:
            raise invalid_request(str(exc)) from exc
        return Generation(engine, tokenizer, stream, prepared.prompt_token_ids, prepared.stops)

    async def collect(request: Request, generation: Generation) -> tuple[str, str | None] | None:
        """The whole output and its finish reason, or None if the client left first."""

        async def run() -> tuple[str, str | None]:
            parts: list[str] = []
            reason = None
            async for piece in generation.pieces():
                parts.append(piece.text)
                reason = piece.finish_reason or reason
            return "".join(parts), reason

        try:
            return await _until_done_or_disconnected(request, run(), metrics.request_cancels.inc)
        except GenerationFailed as exc:
            metrics.request_errors.inc()
            raise exc.error from exc

    def stream_response(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(
            events, media_type=SSE_MEDIA_TYPE, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    async def guarded(generation: Generation, events: AsyncIterator[str], error_event: Callable[[ApiError], str]):
        """Streams `events`; a failure becomes one error event and the end of the stream, and a
        reader that goes away (the task is cancelled) is counted as a cancel."""
        completed = False
        try:
            async for chunk in events:
                yield chunk
            completed = True
        except GenerationFailed as exc:
            completed = True
            metrics.request_errors.inc()
            yield error_event(exc.error)
        finally:
            if not completed:
                metrics.request_cancels.inc()

    # ---- routes -------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> JSONResponse:
        state = engine.health()
        if state.ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": state.reason}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=created, max_model_len=engine.max_model_len)])

    @app.post("/generate", response_model=None)
    async def generate(body: GenerateRequest, request: Request) -> Response:
        sp = body.sampling_params
        sampling = SamplingRequest(
            max_tokens=sp.max_completion_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            seed=sp.seed,
            ignore_eos=sp.ignore_eos,
        )
        prepared = prepare(tokenizer.encode(body.text), sampling)
        generation = start(prepared)
        if not body.stream:
            result = await collect(request, generation)
            if result is None:
                return Response(status_code=499)
            # shortfin answers a whole generation as one `data: ` line, newlines and all.
            return Response(f"data: {result[0]}\n\n", media_type=SSE_MEDIA_TYPE)

        async def events() -> AsyncIterator[str]:
            async for piece in generation.pieces():
                if piece.text:
                    yield _sse(piece.text)

        def error_event(error: ApiError) -> str:
            return _sse(json.dumps(error.body()), event="error")

        return stream_response(guarded(generation, events(), error_event))

    def openai_error_event(error: ApiError) -> str:
        return _sse(json.dumps(error.body()))

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        _refuse_unsupported(body)
        if body.echo:
            raise invalid_request("'echo' is not supported", param="echo")
        if body.logprobs is not None:
            raise invalid_request("'logprobs' is not supported", param="logprobs")
        if body.best_of not in (None, 1):
            raise invalid_request("'best_of' must be 1", param="best_of")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise invalid_request("'prompt' takes one prompt per request", param="prompt")
            prompt = prompt[0]
        prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        prepared = prepare(prompt_ids, body.sampling(body.max_tokens))
        generation = start(prepared)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        hidden = {} if body.return_token_ids else {"choices": {"__all__": {"token_ids"}}}
        now = int(time.time())

        if not body.stream:
            result = await collect(request, generation)
            if result is None:
                return Response(status_code=499)
            text, reason = result
            return JSONResponse(
                CompletionResponse(
                    id=request_id,
                    created=now,
                    model=model_name,
                    choices=[
                        CompletionChoice(
                            text=text,
                            finish_reason=reason,
                            token_ids=generation.token_ids if body.return_token_ids else None,
                        )
                    ],
                    usage=generation.usage,
                ).model_dump(exclude=hidden)
            )

        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            body_ = CompletionResponse(id=request_id, created=now, model=model_name, choices=choices, usage=usage)
            return _sse(body_.model_dump_json(exclude={**hidden, **({} if usage else {"usage": True})}))

        async def events() -> AsyncIterator[str]:
            sent = 0
            async for piece in generation.pieces():
                ids = generation.token_ids[sent:] if body.return_token_ids else None
                sent = len(generation.token_ids)
                yield chunk([CompletionChoice(text=piece.text, finish_reason=piece.finish_reason, token_ids=ids)])
            if include_usage:
                yield chunk([], generation.usage)
            yield _sse("[DONE]")

        return stream_response(guarded(generation, events(), openai_error_event))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        _refuse_unsupported(body)
        if body.logprobs:
            raise invalid_request("'logprobs' is not supported", param="logprobs")
        try:
            prompt = render_chat(tokenizer, [message.model_dump() for message in body.messages])
        except ChatTemplateError as exc:
            raise invalid_request(str(exc), param="messages") from exc
        # The template writes the special tokens (BOS, turn markers) itself.
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        prepared = prepare(prompt_ids, body.sampling(max_tokens))
        generation = start(prepared)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())

        if not body.stream:
            result = await collect(request, generation)
            if result is None:
                return Response(status_code=499)
            text, reason = result
            return JSONResponse(
                ChatCompletionResponse(
                    id=request_id,
                    created=now,
                    model=model_name,
                    choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=reason)],
                    usage=generation.usage,
                ).model_dump()
            )

        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            body_ = ChatCompletionChunk(id=request_id, created=now, model=model_name, choices=choices, usage=usage)
            return _sse(body_.model_dump_json(exclude=None if usage else {"usage"}))

        async def events() -> AsyncIterator[str]:
            yield chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""), finish_reason=None)])
            async for piece in generation.pieces():
                if piece.text:
                    yield chunk([ChatChunkChoice(delta=ChatDelta(content=piece.text), finish_reason=None)])
                if piece.finish_reason is not None:
                    yield chunk([ChatChunkChoice(delta=ChatDelta(), finish_reason=piece.finish_reason)])
            if include_usage:
                yield chunk([], generation.usage)
            yield _sse("[DONE]")

        return stream_response(guarded(generation, events(), openai_error_event))

    routes = frozenset(route.path for route in app.routes if hasattr(route, "path"))
    app.add_middleware(_RequestCounter, metrics=metrics, routes=routes)
    return app


def _refuse_unsupported(body: OpenAISampling) -> None:
    if body.n != 1:
        raise invalid_request("'n' must be 1: one choice per request", param="n")
    if body.presence_penalty != 0.0 or body.frequency_penalty != 0.0:
        raise invalid_request("presence and frequency penalties are not supported", param="presence_penalty")
