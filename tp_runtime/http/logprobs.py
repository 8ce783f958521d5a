"""Sampled tokens' log-probabilities in OpenAI's two shapes.

The executor returns the log-probability of each sampled token (the log-softmax of the logits the
token was drawn from: divided by the temperature, or unscaled when greedy). A token's text is its
bytes decoded on their own, with U+FFFD where a token holds part of a character; chat's `bytes`
gives the exact bytes. The alternatives (`top`) are whatever the executor returned with each token.
"""

from __future__ import annotations

from collections.abc import Sequence

from tp_runtime.http.api_models import ChatLogprobs, CompletionLogprobs
from tp_runtime.http.generation import SampledToken
from tp_runtime.tokenizer import Tokenizer


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def completion_fields(tokenizer: Tokenizer, tokens: Sequence[SampledToken], text_end: int) -> dict[str, list]:
    """Completions' lists, as CompletionLogprobs holds them (a stream's chunk renders them without
    the model: text_chunks.py); text offsets past the text (tokens of a stop string that was cut)
    are the text's end. As vLLM does, top_logprobs lists the sampled token with its alternatives."""
    return {
        "tokens": [token_text(tokenizer, t.token_id) for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [_top_by_text(tokenizer, t) for t in tokens],
        "text_offset": [min(t.text_offset, text_end) for t in tokens],
    }


def for_completion(tokenizer: Tokenizer, tokens: Sequence[SampledToken], text_end: int) -> CompletionLogprobs:
    return CompletionLogprobs(**completion_fields(tokenizer, tokens, text_end))


def _top_by_text(tokenizer: Tokenizer, token: SampledToken) -> dict[str, float]:
    """The legacy shape keys alternatives by their text, which two tokens may share (pieces of one
    character both read U+FFFD): the first keeps the key, so the sampled token's entry is its own
    logprob and the others the most likely of that text."""
    top: dict[str, float] = {}
    for token_id, logprob in ((token.token_id, token.logprob), *token.top):
        top.setdefault(token_text(tokenizer, token_id), logprob)
    return top


def _top(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, object]:
    """A TopLogprob's fields."""
    return {"token": token_text(tokenizer, token_id), "logprob": logprob, "bytes": list(tokenizer.token_bytes(token_id))}


def chat_fields(tokenizer: Tokenizer, tokens: Sequence[SampledToken]) -> dict[str, list]:
    """Chat's entries, as ChatLogprobs holds them (a stream's chunk renders them without the model)."""
    content = []
    for t in tokens:
        alternatives = [_top(tokenizer, token_id, logprob) for token_id, logprob in t.top]
        content.append(_top(tokenizer, t.token_id, t.logprob) | {"top_logprobs": alternatives})
    return {"content": content}


def for_chat(tokenizer: Tokenizer, tokens: Sequence[SampledToken]) -> ChatLogprobs:
    return ChatLogprobs(**chat_fields(tokenizer, tokens))
