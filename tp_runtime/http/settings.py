"""The HTTP server's settings, and the limits derived from the model when they are not given."""

from __future__ import annotations

from dataclasses import dataclass

from tp_runtime.tokenizer import Tokenizer

# One character can take 12 bytes of JSON: an astral character escaped as a surrogate pair,
# "\ud83d\ude00". A body this many times the prompt cap (plus room for the rest of the body) never
# refuses a prompt that the cap would take.
JSON_BYTES_PER_CHAR = 12
BODY_OVERHEAD_BYTES = 1 << 20


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]  # what requests may name; answers report the first
    model_path: str = ""  # /v1/models' `root` (default: the first name)
    api_key: str | None = None  # bearer auth on /v1 and /generate when set
    require_api_key_for_metrics: bool = False
    bind_host: str | None = None  # where the server listens; a loopback address turns the Host check on
    max_request_body_size: int = 0  # bytes; 0: derived from the prompt cap
    max_prompt_chars: int = 0  # 0: the context length times the longest token's characters
    request_body_timeout_s: float = 30.0  # the whole body must arrive within this
    tokenizer_threads: int = 2
    max_logprobs: int = 20  # --max-logprobs: alternatives per token a request may ask for

    def __post_init__(self) -> None:
        names = self.served_model_names
        if not names or any(not name for name in names) or len(set(names)) != len(names):
            raise ValueError(f"served model names must be distinct and non-empty, got {list(names)}")
        if self.request_body_timeout_s <= 0 or self.tokenizer_threads < 1:
            raise ValueError("the request body timeout must be positive and the tokenizer threads at least 1")
        if self.max_request_body_size < 0 or self.max_prompt_chars < 0:
            raise ValueError("body and prompt limits must be positive, or 0 for the derived default")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def prompt_chars_limit(self, max_model_len: int, tokenizer: Tokenizer) -> int:
        """A prompt longer than this cannot fit in the context, whatever its tokens."""
        return self.max_prompt_chars or max_model_len * tokenizer.max_token_chars

    def body_size_limit(self, prompt_chars: int) -> int:
        return self.max_request_body_size or JSON_BYTES_PER_CHAR * prompt_chars + BODY_OVERHEAD_BYTES
