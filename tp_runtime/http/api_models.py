"""Request and response bodies of the HTTP API, as pydantic models (docs/http_api.md).

Types are strict ("5" is not a number, 1 is not a string) and floats finite; ranges are checked by
tp_runtime.http.validation against what the wire and the sampler carry. Nothing is dropped
silently: a field a body does not declare is refused (400 naming it), and the known OpenAI and vLLM
fields this runtime cannot honour are declared only so that validation can refuse them by name
unless they hold their neutral value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer

from protocol.grammar import GrammarSpec
from protocol.sampling_limits import FLOAT32_MAX

# shortfin's default for max_completion_tokens.
GENERATE_DEFAULT_MAX_TOKENS = 50
# OpenAI's default for /v1/completions; chat completions default to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# OpenAI's range for temperature on its endpoints; /generate takes any finite float32.
OPENAI_TEMPERATURE_MAX = 2.0


@dataclass(frozen=True)
class SamplingRequest:
    """The sampling choices of a request body, in the same terms for every endpoint, with the names
    the body gave them (for error messages)."""

    max_tokens: int | None  # None: the rest of the context
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    temperature_max: float = FLOAT32_MAX
    field_prefix: str = ""  # "sampling_params." on /generate
    max_tokens_field: str = "max_tokens"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # as the body sent it: token ids as strings
    top_logprobs: int = 0  # alternatives per sampled token
    top_logprobs_field: str = "top_logprobs"
    n: int = 1
    min_p: float = 0.0
    grammar: GrammarSpec | None = None  # checked by tp_runtime.http.structured_output

    def param(self, name: str) -> str:
        """The body's name for a field: param("max_tokens") is "sampling_params.max_completion_tokens"
        on /generate."""
        return self.field_prefix + (self.max_tokens_field if name == "max_tokens" else name)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class GenerateSamplingParams(_Body):
    max_completion_tokens: int = GENERATE_DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False


class GenerateRequest(_Body):
    """shortfin's /generate body."""

    text: str
    sampling_params: GenerateSamplingParams = GenerateSamplingParams()
    stream: bool = False

    def sampling(self) -> SamplingRequest:
        sp = self.sampling_params
        return SamplingRequest(
            max_tokens=sp.max_completion_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            seed=sp.seed,
            ignore_eos=sp.ignore_eos,
            field_prefix="sampling_params.",
            max_tokens_field="max_completion_tokens",
        )


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output follows the schema either way


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's structured_outputs: one of these constrains the output."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


# OpenAI fields that do not change the output of this server: accepted, and logged once per field
# (as vLLM logs the fields it ignores), rather than refused. reasoning_effort: no model served here
# reasons. Every other field a body does not declare is refused by name.
IGNORED_FIELDS = (
    "store", "metadata", "service_tier", "reasoning_effort", "prompt_cache_key", "safety_identifier", "user",
)


class OpenAISampling(_Body):
    """Fields shared by both OpenAI endpoints."""

    model: str | None = None  # as in vLLM: omitted means the served model
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extension: 0 or -1 is off
    min_p: float = 0.0  # vLLM's extension: 0 is off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1  # choices, sharing the prompt's KV pages
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a JSON key, so a string) -> bias
    min_tokens: int = 0  # vLLM's
    repetition_penalty: float = 1.0  # vLLM's
    # The output's format (tp_runtime/http/structured_output.py): OpenAI's and vLLM's spellings.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # IGNORED_FIELDS: accepted, change nothing.
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    reasoning_effort: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    user: Any = None  # OpenAI's end-user id for abuse monitoring

    @field_validator(
        *(
            "temperature", "top_p", "top_k", "ignore_eos", "stream", "max_tokens", "logprobs", "n", "presence_penalty",
            "frequency_penalty", "min_tokens", "repetition_penalty", "min_p",
        ),
        mode="before",
        check_fields=False,
    )
    @classmethod
    def _null_means_default(cls, value: object, info: ValidationInfo) -> object:
        # Many OpenAI clients send null for an option they leave unset.
        return cls.model_fields[info.field_name].default if value is None else value

    def sampling(
        self,
        max_tokens: int | None,
        max_tokens_field: str,
        top_logprobs: int = 0,
        top_logprobs_field: str = "top_logprobs",
        grammar: GrammarSpec | None = None,
    ) -> SamplingRequest:
        return SamplingRequest(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            temperature_max=OPENAI_TEMPERATURE_MAX,
            max_tokens_field=max_tokens_field,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            logit_bias=self.logit_bias,
            top_logprobs=top_logprobs,
            top_logprobs_field=top_logprobs_field,
            n=self.n,
            min_p=self.min_p,
            grammar=grammar,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(OpenAISampling):
    # Token ids first: in a smart-mode union pydantic tries each member strictly in order and takes
    # the first exact match, and a list of 256 ids failed list[str] item by item first (37 us a
    # request against 9.5). The same inputs validate to the same values in either order.
    prompt: list[int] | str | list[str]
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: int | None = None  # how many alternatives per token; 0: the sampled token's only
    # Extension (as vLLM's): the generated token ids in choices[].token_ids, for exact comparisons.
    return_token_ids: bool = False
    best_of: int | None = None  # taken when it equals n: the n samples are the answer
    echo: Any = None
    suffix: Any = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallIn(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageIn(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls, replayed
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessageIn]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # without tools: accepted, changes nothing
    functions: Any = None
    function_call: Any = None

    def max_tokens_given(self) -> tuple[int | None, str]:
        """(the limit, the field that set it): max_completion_tokens wins over the older max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class TokenizeCompletionRequest(_Body):
    """vLLM's /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    """vLLM's /tokenize with messages, through the chat template."""

    model: str | None = None
    messages: list[ChatMessageIn]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[Tool] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# ---- response bodies -------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions shape: one entry per generated token in every list."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = []

    @model_serializer(mode="wrap")
    def _calls_when_made(self, handler: Any) -> dict[str, Any]:
        # As OpenAI: a message without calls has no tool_calls field.
        return {key: value for key, value in handler(self).items() if key != "tool_calls" or value}


class ToolCallDelta(BaseModel):
    """A call in a stream's delta, whole: OpenAI's shape with its index among the choice's calls."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _without_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI leaves a field out of a delta rather than sending null: only the first has the role.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tp-runtime"
    root: str  # the model path, as vLLM reports it
    parent: None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
