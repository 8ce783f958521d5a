"""A stream's plain text chunk by concatenation is byte for byte the endpoint model's own dump, and
an SSE event takes the short path only where the general one gives the same bytes."""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tp_runtime.http.api_models import ChatCompletionRequest, CompletionChoice, CompletionRequest, CompletionResponse
from tp_runtime.http.generation import Piece
from tp_runtime.http.routes.openai import ChatCompletions, Completions, Reply
from tp_runtime.http.sse import _LINE_BREAK, sse
from tp_runtime.http.text_chunks import TextChunk

REPLY = Reply("chatcmpl-0123", 1_765_000_000, 'a "quoted" model\\name', False, ())
TEXTS = st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(
    ["", '"', "\\", "\n", "\r\n", "\x00\x1f\x7f", "é漢字🙂", "\u2028\u2029", "</script>"]
)


def endpoints() -> list[tuple[object, object]]:
    chat = ChatCompletions(service=None, served_model_names=("m",))
    completions = Completions(service=None, served_model_names=("m",))
    return [
        (chat, ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)),
        (completions, CompletionRequest(model="m", prompt="hi", stream=True)),
        (completions, CompletionRequest(model="m", prompt="hi", stream=True, return_token_ids=True)),
    ]


@pytest.mark.parametrize("endpoint, body", endpoints())
@given(text=TEXTS, index=st.integers(0, 3), ids=st.lists(st.integers(0, 2**31 - 1), max_size=17))
def test_a_rendered_chunk_is_the_models_dump(endpoint, body, text: str, index: int, ids: list[int]) -> None:
    with_ids = endpoint.lists_token_ids(body)
    chunk = TextChunk.of(functools.partial(endpoint.text_chunk, body, REPLY, index), with_ids)
    rendered = chunk.render(text, ids)
    assert rendered == endpoint.text_chunk(body, REPLY, index, text, ids if with_ids else None)
    choice = json.loads(rendered)["choices"][0]
    assert choice["index"] == index and (choice.get("text") == text or choice.get("delta") == {"content": text})
    assert choice.get("token_ids") == (ids if with_ids else None)


def test_a_chunk_that_holds_its_text_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        TextChunk.of(lambda t, _ids: json.dumps([t, t]))


def test_a_chunk_whose_token_ids_are_not_after_its_text_once_is_refused() -> None:
    with pytest.raises(ValueError, match="token ids exactly once after its text"):
        TextChunk.of(lambda t, ids: json.dumps([ids, t]), with_ids=True)


@given(data=TEXTS, event=st.sampled_from([None, "error"]))
def test_the_short_sse_path_gives_the_general_bytes(data: str, event: str | None) -> None:
    general = (f"event: {event}\n" if event else "") + "".join(f"data: {line}\n" for line in _LINE_BREAK.split(data))
    assert sse(data, event) == general + "\n"


@given(text=TEXTS, ids=st.lists(st.integers(0, 2**31 - 1), max_size=17), return_ids=st.booleans())
def test_a_completions_piece_on_the_template_is_the_chunk_its_models_would_dump(
    text: str, ids: list[int], return_ids: bool
) -> None:
    endpoint = Completions(service=None, served_model_names=("m",))
    body = CompletionRequest(model="m", prompt="hi", stream=True, return_token_ids=return_ids)
    reply = Reply("cmpl-0123", 1_765_000_000, "m", False, ())
    reply.text_chunks.append(TextChunk.of(functools.partial(endpoint.text_chunk, body, reply, 0), return_ids))
    piece = Piece(text, None, tuple(ids))
    (rendered,) = endpoint.chunks(body, reply, 0, piece, 0)
    choice = CompletionChoice(index=0, text=text, finish_reason=None, token_ids=ids if return_ids else None)
    dumped = CompletionResponse(id=reply.id, created=reply.created, model=reply.model, choices=[choice])
    hidden = {} if return_ids else {"choices": {"__all__": {"token_ids"}}}
    assert rendered == dumped.model_dump_json(exclude={**hidden, "usage": True})
