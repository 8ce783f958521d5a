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


LOGPROBS_ = st.floats(-1e4, 0.0, allow_nan=False) | st.sampled_from([0.0, -0.0, -1e-45, -9999.0, -0.1])
COMPLETION_FIELDS = st.integers(0, 4).flatmap(lambda n: st.fixed_dictionaries({
    "tokens": st.lists(TEXTS, min_size=n, max_size=n),
    "token_logprobs": st.lists(LOGPROBS_, min_size=n, max_size=n),
    "top_logprobs": st.lists(st.dictionaries(TEXTS, LOGPROBS_, max_size=4), min_size=n, max_size=n),
    "text_offset": st.lists(st.integers(0, 2**31), min_size=n, max_size=n),
}).map(lambda d: {k: d[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}))  # the model's order, as completion_fields
TOP = st.fixed_dictionaries({"token": TEXTS, "logprob": LOGPROBS_, "bytes": st.lists(st.integers(0, 255), max_size=6)}).map(
    lambda d: {k: d[k] for k in ("token", "logprob", "bytes")}  # the model's order, as chat_fields
)
CHAT_FIELDS = st.fixed_dictionaries({
    "content": st.lists(TOP.flatmap(lambda top: st.lists(TOP, max_size=3).map(lambda tops: top | {"top_logprobs": tops})), max_size=3)
})  # fmt: skip


@pytest.mark.parametrize("endpoint, body", endpoints())
@given(data=st.data(), text=TEXTS, index=st.integers(0, 3), ids=st.lists(st.integers(0, 2**31 - 1), max_size=17))
def test_a_rendered_chunk_is_the_models_dump(endpoint, body, data, text: str, index: int, ids: list[int]) -> None:
    with_ids = endpoint.lists_token_ids(body)
    with_logprobs = data.draw(st.booleans(), label="logprobs")
    fields = None
    if with_logprobs:
        fields = data.draw(CHAT_FIELDS if isinstance(endpoint, ChatCompletions) else COMPLETION_FIELDS, label="fields")
    placeholder = endpoint.logprobs_placeholder if with_logprobs else None
    chunk = TextChunk.of(functools.partial(endpoint.text_chunk, body, REPLY, index), with_ids, placeholder)
    rendered = chunk.render(text, ids, fields)
    model = None if fields is None else type(endpoint.logprobs_placeholder("x"))(**fields)
    assert rendered == endpoint.text_chunk(body, REPLY, index, text, ids if with_ids else None, model)
    choice = json.loads(rendered)["choices"][0]
    assert choice["index"] == index and (choice.get("text") == text or choice.get("delta") == {"content": text})
    assert choice.get("token_ids") == (ids if with_ids else None)
    assert choice["logprobs"] == (None if fields is None else json.loads(model.model_dump_json()))
    if with_logprobs:  # a piece with no tokens: the chunk says null, as the model does
        assert chunk.render(text, ids, None) == endpoint.text_chunk(body, REPLY, index, text, ids if with_ids else None, None)


def test_a_chunk_that_holds_its_text_or_token_ids_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="text exactly once"):
        TextChunk.of(lambda t, _ids, _lp: json.dumps([t, t]))
    with pytest.raises(ValueError, match="token ids exactly once"):
        TextChunk.of(lambda t, ids, _lp: json.dumps([ids, t, ids]), with_ids=True)


def test_slots_are_filled_in_the_order_the_chunk_holds_them() -> None:
    chunk = TextChunk.of(lambda t, ids, _lp: json.dumps({"ids": ids, "text": t}, separators=(",", ":")), with_ids=True)
    assert chunk.render("hello", [5, 6]) == '{"ids":[5,6],"text":"hello"}'



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


def test_the_logprobs_fields_are_the_models_in_its_order(tokenizer) -> None:
    # A chunk renders the fields themselves: their keys must come in the model's order.
    from pydantic_core import to_json

    from tp_runtime.http import logprobs
    from tp_runtime.http.generation import SampledToken

    ids = tokenizer.encode("héllo, wörld 漢字")
    tokens = [SampledToken(t, -0.25 * i, 3 * i, tuple(((t + j) % tokenizer.vocab_size, -0.5 - j) for j in range(3))) for i, t in enumerate(ids)]
    fields = logprobs.completion_fields(tokenizer, tokens, 7)
    assert to_json(fields).decode() == logprobs.for_completion(tokenizer, tokens, 7).model_dump_json()
    assert to_json(logprobs.chat_fields(tokenizer, tokens)).decode() == logprobs.for_chat(tokenizer, tokens).model_dump_json()
