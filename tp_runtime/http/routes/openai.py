"""POST /v1/completions and /v1/chat/completions: OpenAI's API, both endpoints through one path.

`OpenAIEndpoint.handle` is that path (validation, prompt, submit, whole answer or stream); the two
subclasses say only how their body becomes a prompt and how their answers are shaped. A request for
n choices answers n choices with their indexes; a stream interleaves their chunks as they come, each
with its index, and the usage counts the prompt once and every choice's tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from tp_runtime.http import logprobs, structured_output, tool_calls, validation
from tp_runtime.http.api_models import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
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
from tp_runtime.http.service import Collected, GenerationService, arrival_time, pieces_of
from tp_runtime.http.sse import DONE, LastEvents, sse
from tp_runtime.http.text_chunks import TextChunk
from tp_runtime.http.tool_calls import FINISH_TOOL_CALLS, ToolCallStream, ToolPlan

Body = TypeVar("Body", bound=OpenAISampling)


@dataclass(frozen=True)
class Reply:
    """What every answer to one request shares."""

    id: str
    created: int
    model: str
    logprobs: bool
    generations: tuple[Generation, ...]  # one per choice, in index order
    tools: ToolPlan | None = None  # chat: what the request's tools ask of its output
    tool_streams: tuple[ToolCallStream, ...] = ()  # a stream's, one per choice
    # A stream's plain text chunk, one per choice: rendered from the reply itself, so added after it.
    text_chunks: list[TextChunk] = dataclasses.field(default_factory=list)

    @property
    def usage(self) -> Usage:
        prompt = self.generations[0].prompt_tokens
        completion = sum(g.completion_tokens for g in self.generations)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


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
        validation.ignored_fields(body)
        self.check_choices(body)
        want_logprobs, alternatives = self.wants_logprobs(body)
        tools = self.tool_plan(body)
        grammar = await service.check_grammar(_grammar(body, tools))
        sampling = body.sampling(*self.max_tokens(body), alternatives, self.alternatives_field, grammar)
        service.check_sampling(sampling)
        prompt, prompt_param = await self.prompt_ids(body)
        generations = service.start(service.prepare(prompt, sampling, prompt_param), arrival, want_logprobs)
        # vLLM's semantics: a request may name any served name; answers carry the first.
        request_id = f"{self.id_prefix}-{os.urandom(16).hex()}"
        streams = tuple(ToolCallStream(tools) for _ in generations) if tools and tools.parses and body.stream else ()
        reply = Reply(
            request_id, int(time.time()), self.served[0], want_logprobs, tuple(generations), tools, streams
        )
        if body.stream:
            reply.text_chunks.extend(
                TextChunk.of(
                    functools.partial(self.text_chunk, body, reply, i), self.lists_token_ids(body),
                    self.logprobs_placeholder if want_logprobs else None,
                )  # fmt: skip
                for i in range(len(generations))
            )
        else:
            collected = await service.collect(request, generations)
            if collected is None:
                return Response(status_code=CLIENT_CLOSED)
            return JSONResponse(self.response(body, reply, collected))

        def closing() -> str:
            usage = sse(self.usage_chunk(reply, reply.usage)) if body.include_usage else ""
            return usage + sse(DONE)

        async def events() -> AsyncGenerator[str, None]:
            # One socket write per piece, which on loopback was 46% of the HTTP thread's time at
            # concurrency 32 (docs/control_plane.md): a piece's chunks go out together, the first
            # piece's with the opening (vLLM too sends the role with the first output), and the
            # last piece's with the usage, [DONE] and the end of the body.
            opening = "".join(sse(chunk) for chunk in self.opening(reply))
            sent, ended = [0] * len(generations), 0
            async for index, piece in pieces_of(generations):
                text = opening + "".join(sse(chunk) for chunk in self.chunks(body, reply, index, piece, sent[index]))
                opening = ""
                sent[index] += len(piece.text)
                ended += piece.finish_reason is not None
                if ended == len(generations):
                    yield LastEvents(text + closing())
                elif text:  # a tool-call stream may hold a piece's text back
                    yield text

        def error_events(error: ApiError) -> list[str]:
            # As vLLM ends a failed stream: the error as a data event, then [DONE].
            return [sse(json.dumps(error.body())), sse(DONE)]

        return service.stream(events(), error_events)

    # ---- what each endpoint says for itself -----------------------------------------------------

    alternatives_field: ClassVar[str]  # the body's field that asks for alternatives per token

    @abstractmethod
    def wants_logprobs(self, body: Body) -> tuple[bool, int]:
        """Whether to return logprobs, and how many alternatives per token."""

    def check_choices(self, body: Body) -> None:
        """Fields about the choices beyond n (completions' best_of)."""

    def tool_plan(self, body: Body) -> ToolPlan | None:
        """What the body's tools ask of the output (chat only)."""
        return None

    @abstractmethod
    def max_tokens(self, body: Body) -> tuple[int | None, str]:
        """The limit on generated tokens and the field that set it."""

    @abstractmethod
    async def prompt_ids(self, body: Body) -> tuple[list[int], str]:
        """The prompt's token ids and the field that holds it."""

    @abstractmethod
    def response(self, body: Body, reply: Reply, collected: Sequence[Collected]) -> dict:
        """The whole answer: collected[i] is choice i's."""

    def opening(self, reply: Reply) -> list[str]:
        """Chunks a stream starts with, before any text."""
        return []

    @abstractmethod
    def chunks(self, body: Body, reply: Reply, index: int, piece: Piece, sent: int) -> list[str]:
        """The stream's chunks for one piece of choice `index`; `sent` characters of its text went
        before it."""

    @abstractmethod
    def usage_chunk(self, reply: Reply, usage: Usage) -> str: ...

    def lists_token_ids(self, body: Body) -> bool:
        """Whether the stream's chunks list their tokens' ids (completions' return_token_ids)."""
        return False

    @abstractmethod
    def text_chunk(
        self, body: Body, reply: Reply, index: int, text: str, token_ids: list[int] | None, logprobs_: BaseModel | None
    ) -> str:
        """The chunk of choice `index` that carries `text` (and, where lists_token_ids, its
        `token_ids`, and its logprobs where given) and nothing else (no end): the one the stream's
        TextChunk renders by concatenation."""

    @staticmethod
    @abstractmethod
    def logprobs_placeholder(marker: str) -> BaseModel:
        """The endpoint's logprobs model holding `marker` once: where a TextChunk's logprobs go."""


def _grammar(body: OpenAISampling, tools: ToolPlan | None) -> structured_output.Asked | None:
    """The output's grammar: the body's format, or what a required or named tool choice needs."""
    asked = structured_output.requested_grammar(body)
    forced = tools.grammar() if tools is not None else None
    if forced is None:
        return asked
    if asked is not None:
        raise invalid_request(
            f"'{asked.param}' and a tool_choice of {tools.mode} both constrain the output: send one", param=asked.param
        )
    return structured_output.Asked(forced, "tools")


def _tokens(collected: Collected) -> list[SampledToken]:
    return [token for piece in collected.pieces for token in piece.tokens]


class Completions(OpenAIEndpoint[CompletionRequest]):
    path = "/v1/completions"
    body_type = CompletionRequest
    id_prefix = "cmpl"
    alternatives_field = "logprobs"

    def wants_logprobs(self, body: CompletionRequest) -> tuple[bool, int]:
        return validation.completion_logprobs(body)

    def check_choices(self, body: CompletionRequest) -> None:
        validation.check_best_of(body)

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

    def response(self, body: CompletionRequest, reply: Reply, collected: Sequence[Collected]) -> dict:
        choices = []
        for index, whole in enumerate(collected):
            choices.append(CompletionChoice(
                index=index,
                text=whole.text,
                finish_reason=whole.finish_reason,
                logprobs=self._logprobs(reply, _tokens(whole), len(whole.text)),
                token_ids=[i for piece in whole.pieces for i in piece.token_ids] if body.return_token_ids else None,
            ))
        answer = CompletionResponse(
            id=reply.id, created=reply.created, model=reply.model, choices=choices, usage=reply.usage
        )
        return answer.model_dump(exclude=self._hidden(body))

    def chunks(self, body: CompletionRequest, reply: Reply, index: int, piece: Piece, sent: int) -> list[str]:
        if piece.finish_reason is None:
            fields = logprobs.completion_fields(self.service.tokenizer, piece.tokens, sent + len(piece.text)) if reply.logprobs else None
            return [reply.text_chunks[index].render(piece.text, piece.token_ids, fields)]
        choice = CompletionChoice(
            index=index,
            text=piece.text,
            finish_reason=piece.finish_reason,
            logprobs=self._logprobs(reply, piece.tokens, sent + len(piece.text)),
            token_ids=list(piece.token_ids) if body.return_token_ids else None,
        )
        chunk = CompletionResponse(id=reply.id, created=reply.created, model=reply.model, choices=[choice])
        return [chunk.model_dump_json(exclude={**self._hidden(body), "usage": True})]

    def lists_token_ids(self, body: CompletionRequest) -> bool:
        return body.return_token_ids

    def text_chunk(
        self, body: CompletionRequest, reply: Reply, index: int, text: str, token_ids: list[int] | None, logprobs_: BaseModel | None
    ) -> str:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs_, finish_reason=None, token_ids=token_ids)
        chunk = CompletionResponse(id=reply.id, created=reply.created, model=reply.model, choices=[choice])
        return chunk.model_dump_json(exclude={**self._hidden(body), "usage": True})

    @staticmethod
    def logprobs_placeholder(marker: str) -> CompletionLogprobs:
        return CompletionLogprobs(tokens=[marker], token_logprobs=[], top_logprobs=None, text_offset=[])

    def usage_chunk(self, reply: Reply, usage: Usage) -> str:
        chunk = CompletionResponse(id=reply.id, created=reply.created, model=reply.model, choices=[], usage=usage)
        return chunk.model_dump_json()

    def _logprobs(self, reply: Reply, tokens: Sequence[SampledToken], text_end: int) -> CompletionLogprobs | None:
        return logprobs.for_completion(self.service.tokenizer, tokens, text_end) if reply.logprobs else None


class ChatCompletions(OpenAIEndpoint[ChatCompletionRequest]):
    path = "/v1/chat/completions"
    body_type = ChatCompletionRequest
    id_prefix = "chatcmpl"
    alternatives_field = "top_logprobs"

    def wants_logprobs(self, body: ChatCompletionRequest) -> tuple[bool, int]:
        return validation.chat_logprobs(body)

    def max_tokens(self, body: ChatCompletionRequest) -> tuple[int | None, str]:
        return body.max_tokens_given()

    def tool_plan(self, body: ChatCompletionRequest) -> ToolPlan | None:
        return tool_calls.plan(body)

    async def prompt_ids(self, body: ChatCompletionRequest) -> tuple[list[int], str]:
        for index, message in enumerate(body.messages):
            if message.name is not None:
                raise invalid_request(
                    f"'messages.{index}.name' is not supported: the chat template is given role and content only",
                    code="unsupported_parameter",
                    param=f"messages.{index}.name",
                )
        tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
        return await self.service.encode_chat([m.model_dump() for m in body.messages], tools), "messages"

    def response(self, body: ChatCompletionRequest, reply: Reply, collected: Sequence[Collected]) -> dict:
        choices = []
        for index, whole in enumerate(collected):
            message, reason = AssistantMessage(content=whole.text), whole.finish_reason
            if reply.tools is not None and reply.tools.parses:
                content, calls = reply.tools.calls(whole.text)
                message = AssistantMessage(content=content, tool_calls=tool_calls.tool_calls_out(calls))
                reason = FINISH_TOOL_CALLS if calls and reason == "stop" else reason
            choices.append(ChatChoice(
                index=index, message=message, finish_reason=reason, logprobs=self._logprobs(reply, _tokens(whole))
            ))
        answer = ChatCompletionResponse(
            id=reply.id, created=reply.created, model=reply.model, choices=choices, usage=reply.usage
        )
        return answer.model_dump()

    def _chunk(self, reply: Reply, choice: ChatChunkChoice) -> str:
        chunk = ChatCompletionChunk(id=reply.id, created=reply.created, model=reply.model, choices=[choice])
        return chunk.model_dump_json(exclude={"usage"})

    def opening(self, reply: Reply) -> list[str]:
        # As vLLM: each choice's first delta carries the role.
        opening = ChatDelta(role="assistant", content="")
        return [
            self._chunk(reply, ChatChunkChoice(index=index, delta=opening, finish_reason=None))
            for index in range(len(reply.generations))
        ]

    def chunks(self, body: ChatCompletionRequest, reply: Reply, index: int, piece: Piece, sent: int) -> list[str]:
        # The piece's logprobs go with its text, or with the closing chunk when it has none.
        fields = logprobs.chat_fields(self.service.tokenizer, piece.tokens) if reply.logprobs and piece.tokens else None
        text, calls, reason = piece.text, [], piece.finish_reason
        if reply.tool_streams:  # tool calls: text that may start one is held until the end
            stream = reply.tool_streams[index]
            text = stream.feed(text)
            if reason is not None:
                rest, calls = stream.finish()
                text += rest
                reason = FINISH_TOOL_CALLS if calls and reason == "stop" else reason
        out = []
        if text:
            out.append(reply.text_chunks[index].render(text, (), fields))
            fields = None
        if calls:
            choice = ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=calls), finish_reason=None)
            out.append(self._chunk(reply, choice))
        if reason is not None:
            choice = ChatChunkChoice(
                index=index, delta=ChatDelta(), logprobs=None if fields is None else ChatLogprobs(**fields), finish_reason=reason
            )
            out.append(self._chunk(reply, choice))
        return out

    def text_chunk(
        self, body: ChatCompletionRequest, reply: Reply, index: int, text: str, token_ids: list[int] | None, logprobs_: BaseModel | None
    ) -> str:
        return self._chunk(reply, ChatChunkChoice(index=index, delta=ChatDelta(content=text), logprobs=logprobs_, finish_reason=None))

    @staticmethod
    def logprobs_placeholder(marker: str) -> ChatLogprobs:
        return ChatLogprobs(content=[ChatTokenLogprob(token=marker, logprob=0.0, bytes=None, top_logprobs=[])])

    def usage_chunk(self, reply: Reply, usage: Usage) -> str:
        chunk = ChatCompletionChunk(id=reply.id, created=reply.created, model=reply.model, choices=[], usage=usage)
        return chunk.model_dump_json()

    def _logprobs(self, reply: Reply, tokens: Sequence[SampledToken]) -> ChatLogprobs | None:
        return logprobs.for_chat(self.service.tokenizer, tokens) if reply.logprobs else None


def endpoints(
    service: GenerationService, served_model_names: Sequence[str]
) -> list[tuple[str, Callable[[Request], Awaitable[Response]]]]:
    routes = (Completions(service, served_model_names), ChatCompletions(service, served_model_names))
    return [(endpoint.path, endpoint.handle) for endpoint in routes]
