"""POST /v1/completions and /v1/chat/completions: OpenAI's API, both endpoints through one path.

`OpenAIEndpoint.handle` is that path (validation, prompt, submit, whole answer or stream); the two
subclasses say only how their body becomes a prompt and how their answers are shaped.
"""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tp_runtime.http import logprobs, validation
from tp_runtime.http.api_models import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    OpenAISampling,
    Usage,
)
from tp_runtime.http.body import read_json
from tp_runtime.http.errors import ApiError, invalid_request, unsupported
from tp_runtime.http.generation import Generation, Piece, SampledToken
from tp_runtime.http.routes.generate import CLIENT_CLOSED
from tp_runtime.http.service import Collected, GenerationService, arrival_time
from tp_runtime.http.sse import DONE, sse

Body = TypeVar("Body", bound=OpenAISampling)


@dataclass(frozen=True)
class Reply:
    """What every answer to one request shares."""

    id: str
    created: int
    model: str
    logprobs: bool
    generation: Generation


class OpenAIEndpoint(ABC, Generic[Body]):
    path: ClassVar[str]
    body_type: ClassVar[type[OpenAISampling]]
    id_prefix: ClassVar[str]

    def __init__(self, service: GenerationService, served_model_names: Sequence[str]):
        self.service = service
        self.served = tuple(served_model_names)

    async def handle(self, request: Request) -> Response:
        service, arrival = self.service, arrival_time()
        body = await read_json(request, self.body_type)
        validation.check_model(body.model, self.served)
        validation.refuse_unsupported(body)
        want_logprobs = self.wants_logprobs(body)
        sampling = body.sampling(*self.max_tokens(body))
        service.check_sampling(sampling)
        prompt, prompt_param = await self.prompt_ids(body)
        generation = service.start(service.prepare(prompt, sampling, prompt_param), arrival)
        # vLLM's semantics: a request may name any served name; answers carry the first.
        request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        reply = Reply(request_id, int(time.time()), self.served[0], want_logprobs, generation)
        if not body.stream:
            collected = await service.collect(request, generation)
            if collected is None:
                return Response(status_code=CLIENT_CLOSED)
            return JSONResponse(self.response(body, reply, collected))

        async def events() -> AsyncIterator[str]:
            for chunk in self.opening(reply):
                yield sse(chunk)
            sent = 0
            async for piece in generation.pieces():
                for chunk in self.chunks(body, reply, piece, sent):
                    yield sse(chunk)
                sent += len(piece.text)
            if body.include_usage:
                yield sse(self.usage_chunk(reply, generation.usage))
            yield sse(DONE)

        def error_events(error: ApiError) -> list[str]:
            # As vLLM ends a failed stream: the error as a data event, then [DONE].
            return [sse(json.dumps(error.body())), sse(DONE)]

        return service.stream(events(), error_events)

    # ---- what each endpoint says for itself -----------------------------------------------------

    @abstractmethod
    def wants_logprobs(self, body: Body) -> bool: ...

    @abstractmethod
    def max_tokens(self, body: Body) -> tuple[int | None, str]:
        """The limit on generated tokens and the field that set it."""

    @abstractmethod
    async def prompt_ids(self, body: Body) -> tuple[list[int], str]:
        """The prompt's token ids and the field that holds it."""

    @abstractmethod
    def response(self, body: Body, reply: Reply, collected: Collected) -> dict: ...

    def opening(self, reply: Reply) -> list[str]:
        """Chunks a stream starts with, before any text."""
        return []

    @abstractmethod
    def chunks(self, body: Body, reply: Reply, piece: Piece, sent: int) -> list[str]:
        """The stream's chunks for one piece; `sent` characters of text went before it."""

    @abstractmethod
    def usage_chunk(self, reply: Reply, usage: Usage) -> str: ...


def _tokens(collected: Collected) -> list[SampledToken]:
    return [token for piece in collected.pieces for token in piece.tokens]


class Completions(OpenAIEndpoint[CompletionRequest]):
    path = "/v1/completions"
    body_type = CompletionRequest
    id_prefix = "cmpl"

    def wants_logprobs(self, body: CompletionRequest) -> bool:
        return validation.completion_logprobs(body)

    def max_tokens(self, body: CompletionRequest) -> tuple[int | None, str]:
        return body.max_tokens, "max_tokens"

    async def prompt_ids(self, body: CompletionRequest) -> tuple[list[int], str]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise unsupported("prompt", "takes one prompt per request (a string or a list of one string)")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self.service.encode_prompt(prompt, "prompt"), "prompt"
        return list(prompt), "prompt"

    @staticmethod
    def _hidden(body: CompletionRequest) -> dict:
        return {} if body.return_token_ids else {"choices": {"__all__": {"token_ids"}}}

    def response(self, body: CompletionRequest, reply: Reply, collected: Collected) -> dict:
        tokens = _tokens(collected)
        choice = CompletionChoice(
            text=collected.text,
            finish_reason=collected.finish_reason,
            logprobs=self._logprobs(reply, tokens, len(collected.text)),
            token_ids=[t.token_id for t in tokens] if body.return_token_ids else None,
        )
        answer = CompletionResponse(
            id=reply.id, created=reply.created, model=reply.model, choices=[choice], usage=reply.generation.usage
        )
        return answer.model_dump(exclude=self._hidden(body))

    def chunks(self, body: CompletionRequest, reply: Reply, piece: Piece, sent: int) -> list[str]:
        choice = CompletionChoice(
            text=piece.text,
            finish_reason=piece.finish_reason,
            logprobs=self._logprobs(reply, piece.tokens, sent + len(piece.text)),
            token_ids=[t.token_id for t in piece.tokens] if body.return_token_ids else None,
        )
        chunk = CompletionResponse(id=reply.id, created=reply.created, model=reply.model, choices=[choice])
        return [chunk.model_dump_json(exclude={**self._hidden(body), "usage": True})]

    def usage_chunk(self, reply: Reply, usage: Usage) -> str:
        chunk = CompletionResponse(id=reply.id, created=reply.created, model=reply.model, choices=[], usage=usage)
        return chunk.model_dump_json()

    def _logprobs(self, reply: Reply, tokens: Sequence[SampledToken], text_end: int) -> CompletionLogprobs | None:
        return logprobs.for_completion(self.service.tokenizer, tokens, text_end) if reply.logprobs else None


class ChatCompletions(OpenAIEndpoint[ChatCompletionRequest]):
    path = "/v1/chat/completions"
    body_type = ChatCompletionRequest
    id_prefix = "chatcmpl"

    def wants_logprobs(self, body: ChatCompletionRequest) -> bool:
        return validation.chat_logprobs(body)

    def max_tokens(self, body: ChatCompletionRequest) -> tuple[int | None, str]:
        return body.max_tokens_given()

    async def prompt_ids(self, body: ChatCompletionRequest) -> tuple[list[int], str]:
        for index, message in enumerate(body.messages):
            if message.name is not None:
                raise invalid_request(
                    f"'messages.{index}.name' is not supported: the chat template is given role and content only",
                    code="unsupported_parameter",
                    param=f"messages.{index}.name",
                )
        return await self.service.encode_chat([m.model_dump() for m in body.messages]), "messages"

    def response(self, body: ChatCompletionRequest, reply: Reply, collected: Collected) -> dict:
        choice = ChatChoice(
            message=AssistantMessage(content=collected.text),
            finish_reason=collected.finish_reason,
            logprobs=self._logprobs(reply, _tokens(collected)),
        )
        answer = ChatCompletionResponse(
            id=reply.id, created=reply.created, model=reply.model, choices=[choice], usage=reply.generation.usage
        )
        return answer.model_dump()

    def _chunk(self, reply: Reply, choice: ChatChunkChoice) -> str:
        chunk = ChatCompletionChunk(id=reply.id, created=reply.created, model=reply.model, choices=[choice])
        return chunk.model_dump_json(exclude={"usage"})

    def opening(self, reply: Reply) -> list[str]:
        return [self._chunk(reply, ChatChunkChoice(delta=ChatDelta(role="assistant", content=""), finish_reason=None))]

    def chunks(self, body: ChatCompletionRequest, reply: Reply, piece: Piece, sent: int) -> list[str]:
        # The piece's logprobs go with its text, or with the closing chunk when it has none.
        logprobs_ = self._logprobs(reply, piece.tokens) if piece.tokens else None
        out = []
        if piece.text:
            choice = ChatChunkChoice(delta=ChatDelta(content=piece.text), logprobs=logprobs_, finish_reason=None)
            out.append(self._chunk(reply, choice))
            logprobs_ = None
        if piece.finish_reason is not None:
            choice = ChatChunkChoice(delta=ChatDelta(), logprobs=logprobs_, finish_reason=piece.finish_reason)
            out.append(self._chunk(reply, choice))
        return out

    def usage_chunk(self, reply: Reply, usage: Usage) -> str:
        chunk = ChatCompletionChunk(id=reply.id, created=reply.created, model=reply.model, choices=[], usage=usage)
        return chunk.model_dump_json()

    def _logprobs(self, reply: Reply, tokens: Sequence[SampledToken]) -> ChatLogprobs | None:
        return logprobs.for_chat(self.service.tokenizer, tokens) if reply.logprobs else None


def register(app: FastAPI, service: GenerationService, served_model_names: Sequence[str]) -> None:
    for endpoint_type in (Completions, ChatCompletions):
        endpoint = endpoint_type(service, served_model_names)
        app.add_api_route(endpoint.path, endpoint.handle, methods=["POST"], response_model=None)
