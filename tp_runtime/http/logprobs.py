"""Sampled tokens' log-probabilities in OpenAI's two shapes.

The executor returns the log-probability of each sampled token (the log-softmax of the logits the
token was drawn from: divided by the temperature, or unscaled when greedy). A token's text is its
bytes decoded on their own, with U+FFFD where a token holds part of a character; chat's `bytes`
gives the exact bytes. The alternatives (`top`) are whatever the executor returned with each token.
"""

from __future__ import annotations

from collections.abc import Sequence

from tp_runtime.http.api_models import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from tp_runtime.http.generation import SampledToken
from tp_runtime.tokenizer import Tokenizer


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def for_completion(tokenizer: Tokenizer, tokens: Sequence[SampledToken], text_end: int) -> CompletionLogprobs:
    """Completions' lists; text offsets past the text (tokens of a stop string that was cut) are
    the text's end. As vLLM does, top_logprobs lists the sampled token with its alternatives."""
    return CompletionLogprobs(
        tokens=[token_text(tokenizer, t.token_id) for t in tokens],
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=[
            {token_text(tokenizer, token_id): logprob for token_id, logprob in ((t.token_id, t.logprob), *t.top)}
            for t in tokens
        ],
        text_offset=[min(t.text_offset, text_end) for t in tokens],
    )


def _top(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    spelling = list(tokenizer.token_bytes(token_id))
    return TopLogprob(token=token_text(tokenizer, token_id), logprob=logprob, bytes=spelling)


def for_chat(tokenizer: Tokenizer, tokens: Sequence[SampledToken]) -> ChatLogprobs:
    content = []
    for t in tokens:
        sampled = _top(tokenizer, t.token_id, t.logprob)
        alternatives = [_top(tokenizer, token_id, logprob) for token_id, logprob in t.top]
        content.append(ChatTokenLogprob(**sampled.model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)
