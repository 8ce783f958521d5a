"""Request and response bodies of the HTTP API, as pydantic models (docs/http_api.md).

Strict types: "5" is not a number and 1 is not a string. Unknown OpenAI fields are ignored, as
OpenAI servers do; known ones this runtime cannot honour are refused by the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# shortfin's default for max_completion_tokens.
GENERATE_DEFAULT_MAX_TOKENS = 50
# OpenAI's default for /v1/completions; chat completions default to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class SamplingRequest:
    """The sampling choices of a request body, in the same terms for every endpoint."""

    max_tokens: int | None  # None: the rest of the context
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


class _Strict(BaseModel):
    # Strict: "5" is not a number and 1 is not a string; wrong types are the client's bug to hear of.
    model_config = ConfigDict(strict=True, extra="ignore")


class GenerateSamplingParams(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid")

    max_completion_tokens: int = Field(GENERATE_DEFAULT_MAX_TOKENS, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    ignore_eos: bool = False


class GenerateRequest(_Strict):
    """shortfin's /generate body."""

    model_config = ConfigDict(strict=True, extra="forbid")

    text: str
    sampling_params: GenerateSamplingParams = GenerateSamplingParams()
    stream: bool = False


class StreamOptions(_Strict):
    include_usage: bool = False


class OpenAISampling(_Strict):
    """Fields shared by both OpenAI endpoints. Unknown fields are ignored, as OpenAI servers do;
    known ones that this runtime cannot honour are refused rather than silently ignored."""

    model: str | None = None  # as in vLLM: omitted means the served model
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator(
        *("temperature", "top_p", "top_k", "n", "presence_penalty", "frequency_penalty"),
        *("ignore_eos", "stream", "max_tokens"),
        mode="before",
        check_fields=False,
    )
    @classmethod
    def _null_means_default(cls, value: object, info: ValidationInfo) -> object:
        # Many OpenAI clients send null for an option they leave unset.
        return cls.model_fields[info.field_name].default if value is None else value

    def sampling(self, max_tokens: int | None) -> SamplingRequest:
        return SamplingRequest(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    # Extension (as vLLM's): the generated token ids in choices[].token_ids, for exact comparisons.
    return_token_ids: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessageIn(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessageIn]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False


# ---- response bodies -------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tp-runtime"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- generation ------------------------------------------------------------------------------------
