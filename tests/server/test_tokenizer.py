"""The tokenizer built from the embedded SmolLM2 GGUF, incremental detokenization, chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from server.fake_engine import default_model_path

from tp_runtime.chat import ChatMessage, ChatTemplateError, render_chat
from tp_runtime.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError, _WindowedDetokenizer

SAMPLES = [
    "What is 2+2?",
    "Hello world 12345 3.14159 1,000,000",
    "  leading spaces\t\ttabs\n\n\nnewlines  ",
    "naïve café — 日本語のテキスト 🎉👨‍👩‍👧 emoji",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "don't I'll we've <|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers", reason="transformers is the reference tokenizer")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_ids_equal_transformers(tokenizer, reference):
    for text in SAMPLES:
        assert tokenizer.encode(text) == reference(text)["input_ids"], text


def test_special_tokens_from_metadata(tokenizer):
    assert tokenizer.bos_token_id == 1 and tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.eos_token_ids == (2,) and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.vocab_size == 49152
    # Control tokens stay whole, and add_bos is false in this file.
    assert tokenizer.encode("<|im_start|>") == [1]


_ANY_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(st.lists(_ANY_TEXT | st.sampled_from(SAMPLES + ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]), max_size=6).map("".join))
def test_encode_gives_the_ids_of_the_tokenizers_own_encode(tokenizer, text):
    """Tokenizer.encode takes the batch call that skips offsets: the ids are those of the call
    that keeps them, special tokens among the text included."""
    for special in (True, False):
        assert tokenizer.encode(text, special) == tokenizer._backend.encode(text, add_special_tokens=special).ids


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_decode_skips_special_tokens(tokenizer):
    assert tokenizer.decode(tokenizer.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def incremental(tokenizer, ids, prompt=(), detokenizer=IncrementalDetokenizer):
    detokenizer = detokenizer(tokenizer, prompt)
    deltas = [detokenizer.add(token) for token in ids]
    return deltas, detokenizer.flush()


# A byte-level tokenizer's detokenizer reads its tokens with an incremental UTF-8 decoder; the
# windowed reading, which it keeps for a prompt that ends inside a character, is held to the same.
BOTH_READINGS = pytest.mark.parametrize("detokenizer", [IncrementalDetokenizer, _WindowedDetokenizer], ids=["decoder", "windowed"])


@BOTH_READINGS
@pytest.mark.parametrize("text", ["日本語のテキスト", "🎉👨‍👩‍👧 ok", "naïve € 😀😀 中文"])
def test_incremental_never_emits_broken_characters(tokenizer, text, detokenizer):
    ids = tokenizer.encode(text)
    # The premise: some of these tokens end inside a character when decoded alone.
    assert any("\ufffd" in tokenizer.decode([token]) for token in ids)
    deltas, tail = incremental(tokenizer, ids, detokenizer=detokenizer)
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) + tail == text


@BOTH_READINGS
@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_incremental_equals_full_decode(tokenizer, detokenizer, text):
    ids = tokenizer.encode(text)
    # Characters whose bytes the vocabulary lacks (e.g. unassigned planes) cannot round-trip at all.
    assume(tokenizer.decode(ids) == text)
    deltas, tail = incremental(tokenizer, ids, detokenizer=detokenizer)
    assert "".join(deltas) + tail == text
    assert not any("\ufffd" in delta for delta in deltas) or "\ufffd" in text


@BOTH_READINGS
def test_incremental_after_prompt_context(tokenizer, detokenizer):
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    ids = tokenizer.encode("The answer is 4.")
    deltas, tail = incremental(tokenizer, ids, prompt, detokenizer)
    assert "".join(deltas) + tail == "The answer is 4."


@BOTH_READINGS
def test_flush_drops_an_unfinished_character(tokenizer, detokenizer):
    ids = tokenizer.encode("ok 🎉")
    cut = next(i for i in range(1, len(ids) + 1) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    deltas, tail = incremental(tokenizer, ids[:cut], detokenizer=detokenizer)
    assert "".join(deltas) + tail == "ok "


@BOTH_READINGS
def test_flush_keeps_a_replacement_character_the_tokens_spell_whole(tokenizer, detokenizer):
    # Hypothesis found it: a text that is U+FFFD itself (its three bytes) ended with it, and flush
    # took it for an unfinished character.
    for text in ("\ufffd", "ok \ufffd", "\ufffd\ufffd"):
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        deltas, tail = incremental(tokenizer, ids, detokenizer=detokenizer)
        assert "".join(deltas) + tail == text


@BOTH_READINGS
def test_flush_drops_only_the_unfinished_character_and_leaves_out_special_tokens(tokenizer, single_byte_tokens, detokenizer):
    lead = tokenizer.encode("中")  # its three bytes; a prefix of them is an unfinished character
    stop = tokenizer.eos_token_ids[0]
    first_byte = single_byte_tokens["中".encode()[:1]]
    whole = tokenizer.encode("\ufffd")
    for ids, want in (
        ([*tokenizer.encode("ok"), first_byte], "ok"),  # stopped inside a character
        ([*tokenizer.encode("ok"), first_byte, stop], "ok"),  # and then the stop token, which decode() skips
        ([*whole, first_byte], "\ufffd"),  # a U+FFFD of its own before the unfinished one stays
        ([*lead, *whole], "中\ufffd"),
    ):
        deltas, tail = incremental(tokenizer, ids, detokenizer=detokenizer)
        assert "".join(deltas) + tail == want, ids


@BOTH_READINGS
def test_a_surrogate_s_first_bytes_are_the_text_decode_spells(tokenizer, single_byte_tokens, detokenizer):
    """ED A0-BF begins a surrogate, no character in UTF-8: decode() spells the two bytes as two U+FFFD
    whatever follows. Hypothesis found CPython's decoder holding them (for its surrogatepass
    handler), so that a stream ending on them lost them."""
    lead, second = single_byte_tokens[b"\xed"], single_byte_tokens[b"\xa1"]
    for ids in ([lead, second], [lead, second, second], [lead, second, *tokenizer.encode("A")]):
        deltas, tail = incremental(tokenizer, ids, detokenizer=detokenizer)
        assert "".join(deltas) + tail == tokenizer.decode(ids), ids


def test_the_decoder_sends_a_surrogate_s_first_bytes_as_their_token_comes(tokenizer, single_byte_tokens):
    lead, second = single_byte_tokens[b"\xed"], single_byte_tokens[b"\xa1"]
    assert incremental(tokenizer, [lead, second, second]) == (["", "\ufffd\ufffd", "\ufffd"], "")
    assert stepwise(tokenizer, [[lead, second]]) == (["\ufffd\ufffd"], "")


@pytest.mark.parametrize(
    ("text", "open_bytes"),
    [("ok", b""), ("é", b""), ("🎉", b""), ("\ufffd", b"")],
)  # fmt: skip
def test_open_character_is_empty_on_whole_characters(tokenizer, text: str, open_bytes: bytes):
    assert tokenizer.open_character(tokenizer.encode(text)) == open_bytes


def test_open_character_is_the_unfinished_prefix_and_not_invalid_bytes(tokenizer, single_byte_tokens):
    single = single_byte_tokens
    for data, open_bytes in (
        ("中".encode()[:2], "中".encode()[:2]), ("🎉".encode()[:3], "🎉".encode()[:3]), ("é".encode()[:1], "é".encode()[:1]),
        # Past U+10FFFF, overlong, stray, a surrogate's first two bytes (CPython's decoder holds those).
        (b"\xf4\x90", b""), (b"\xe0\x80", b""), (b"\x80\x80", b""), (b"\xed\xa0", b""), (b"\xed\xbf", b""),
        ("ok".encode() + "中".encode()[:1], "中".encode()[:1]), (b"\xed\x9f", b"\xed\x9f"),  # U+D7FF's first two
    ):  # fmt: skip
        ids = [single[bytes([b])] for b in data]
        assert tokenizer.open_character(ids) == open_bytes, data


def test_chat_template_is_chatml_with_default_system_prompt(tokenizer):
    prompt = render_chat(tokenizer, [{"role": "user", "content": "What is 2+2?"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    own_system = render_chat(tokenizer, [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")])
    assert own_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and "SmolLM" not in own_system


def test_chat_template_matches_transformers(tokenizer, reference):
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Sure?"},
    ]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_chat(tokenizer, messages) == expected


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ([], "empty"),
        ("hi", "must be a list"),
        ([42], "messages[0] must be an object"),
        ([{"role": "robot", "content": "x"}], "'robot'"),
        ([{"role": "user"}], "messages[0].content is missing"),
        ([{"role": "user", "content": 3}], "must be a string"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text content"),
    ],
)
def test_malformed_messages(tokenizer, messages, fragment):
    with pytest.raises(ChatTemplateError) as info:
        render_chat(tokenizer, messages)
    assert fragment in str(info.value)


class _TemplateOnly:
    """Just what render_chat reads from a tokenizer."""

    def __init__(self, template):
        self.chat_template = template
        self.bos_token = "<s>"
        self.eos_token = "</s>"


def test_template_runs_sandboxed():
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError, match="failed"):
        render_chat(_TemplateOnly(escape), [{"role": "user", "content": "x"}])


def test_template_raise_exception_is_a_chat_error():
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="system first"):
        render_chat(_TemplateOnly(template), [{"role": "user", "content": "x"}])


def test_no_template_is_a_chat_error():
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(_TemplateOnly(None), [{"role": "user", "content": "x"}])


def test_hugging_face_directory(tokenizer, tmp_path: Path):
    # A tokenizer.json written from the GGUF-built tokenizer, plus the config files of a HF repo.
    tokenizer._backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": {"content": "<|im_end|>"},
                "chat_template": tokenizer.chat_template,
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_model_path(tmp_path)
    assert loaded.bos_token_id == 1
    assert loaded.eos_token_ids == (2, 0)
    assert loaded.chat_template == tokenizer.chat_template
    for text in SAMPLES:
        assert loaded.encode(text) == tokenizer.encode(text)


def test_unusable_model_files(tmp_path: Path):
    with pytest.raises(TokenizerError, match="no model"):
        Tokenizer.from_model_path(tmp_path / "missing.gguf")
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_model_path(tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(TokenizerError, match="not a GGUF file"):
        Tokenizer.from_model_path(bad)
    truncated = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as f:
        truncated.write_bytes(f.read(4096))
    with pytest.raises(TokenizerError, match="truncated"):
        Tokenizer.from_model_path(truncated)


def write_sentencepiece_gguf(path: Path) -> None:
    """A tiny Llama 2-style vocabulary: <unk> <s> </s>, 256 byte-fallback tokens, scored pieces."""
    import gguf
    import numpy as np

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "lo", "llo", "▁he", "hello", "▁hello"]
    pieces += ["▁w", "or", "▁wor", "ld", "▁world", "é"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens + pieces)
    writer.add_token_types(types + [1] * len(pieces))
    writer.add_token_scores([0.0] * len(tokens) + [-float(i) for i in range(len(pieces))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("unused", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def stepwise(tokenizer, events, prompt=(), detokenizer=IncrementalDetokenizer):
    """Each event's tokens through extend(): a step's tokens at once, as a stream without logprobs."""
    detokenizer = detokenizer(tokenizer, prompt)
    texts = [detokenizer.extend(event) for event in events]
    return texts, detokenizer.flush()


def _events(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    return [ids[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def _extend_matches_add(tokenizer, ids, cuts, prompt, detokenizer=IncrementalDetokenizer):
    """A step's text from extend() is every token's add() of it, joined, and so is what follows."""
    events = _events(ids, cuts)
    deltas, tail = incremental(tokenizer, ids, prompt, detokenizer)
    texts, step_tail = stepwise(tokenizer, events, prompt, detokenizer)
    # After every step the text sent so far is add()'s: nothing is held back longer, or sent sooner.
    end = 0
    for i, event in enumerate(events):
        end += len(event)
        assert "".join(texts[: i + 1]) == "".join(deltas[:end])
    assert step_tail == tail


@pytest.fixture(scope="module")
def partial_tokens(tokenizer) -> list[int]:
    """Tokens whose bytes alone are not whole characters (or not UTF-8): where grouping could show."""
    return [i for i in range(tokenizer.vocab_size) if "\ufffd" in tokenizer.decode([i])]


def _ids(vocab_size: int, partial: list[int], specials: int):
    return st.lists(
        st.one_of(st.sampled_from(partial), st.integers(0, vocab_size - 1), st.integers(0, specials)),
        min_size=1, max_size=24,
    )


@BOTH_READINGS
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_steps_tokens_at_once_give_the_text_of_each_token_in_turn(tokenizer, partial_tokens, detokenizer, data):
    assert tokenizer.byte_level  # the windowed reading of the embedded tokenizer takes one window a step
    ids = data.draw(_ids(tokenizer.vocab_size, partial_tokens, 16))
    cuts = data.draw(st.lists(st.integers(0, 64), max_size=6))
    prompt = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=5))
    _extend_matches_add(tokenizer, ids, cuts, prompt, detokenizer)


@settings(max_examples=500, deadline=None)
@given(data=st.data())
def test_a_byte_level_decode_in_c_is_decode(tokenizer, partial_tokens, data):
    """The windowed reading (_WindowedDetokenizer) reads a byte-level tokenizer's text from its
    tokens' bytes: the same text as decode(), for partial characters, invalid runs, special tokens
    and ids past the vocabulary (and none from a negative id, which decode() refuses)."""
    ids = data.draw(_ids(tokenizer.vocab_size, partial_tokens, 16) | st.lists(st.integers(0, tokenizer.vocab_size + 8), max_size=8))
    assert tokenizer.decode_byte_level(ids) == tokenizer.decode(ids)
    assert tokenizer.text_bytes([-1, *ids, -(2**40)]) == tokenizer.text_bytes(ids)


@pytest.fixture(scope="module")
def spm(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    write_sentencepiece_gguf(path)
    return Tokenizer.from_model_path(path)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_steps_tokens_at_once_give_add_s_text_on_a_byte_fallback_tokenizer(spm, data):
    # Byte fallback spells an invalid run of bytes as one U+FFFD a byte, valid ones included, so a
    # window's text depends on where it starts: extend() goes token by token here.
    assert not spm.byte_level
    partial = [i for i in range(spm.vocab_size) if "\ufffd" in spm.decode([i])]
    ids = data.draw(_ids(spm.vocab_size, partial, 2))
    cuts = data.draw(st.lists(st.integers(0, 64), max_size=6))
    _extend_matches_add(spm, ids, cuts, spm.encode("hello"))
    # Nor does a UTF-8 decoder read its bytes: the detokenizer keeps the windowed reading.
    events = _events(ids, cuts)
    assert stepwise(spm, events, spm.encode("hello")) == stepwise(spm, events, spm.encode("hello"), _WindowedDetokenizer)


@BOTH_READINGS
@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40), st.lists(st.integers(0, 64), max_size=6))
def test_a_steps_tokens_at_once_give_the_text_they_encode(tokenizer, detokenizer, text, cuts):
    ids = tokenizer.encode(text)
    assume(ids and tokenizer.decode(ids) == text)
    texts, tail = stepwise(tokenizer, _events(ids, cuts), detokenizer=detokenizer)
    assert "".join(texts) + tail == text
    assert not any("\ufffd" in t for t in texts)


def _completed(tokenizer, ids) -> str:
    """decode() of the tokens without the U+FFFD of a trailing unfinished character, which a later
    token may still complete."""
    text = tokenizer.decode(ids)
    return text[:-1] if tokenizer.open_character(ids) else text


@pytest.fixture(scope="module")
def single_byte_tokens(tokenizer) -> dict[bytes, int]:
    return {tokenizer.token_bytes(t): t for t in range(tokenizer.vocab_size) if len(tokenizer.token_bytes(t)) == 1}


def _spelled(tokenizer, single_byte_tokens, parts) -> list[int]:
    """Tokens for each part: a text's, or one byte's own token."""
    return [t for part in parts for t in ([single_byte_tokens[part]] if isinstance(part, bytes) else tokenizer.encode(part))]


ZHONG, PARTY = "中".encode(), "🎉".encode()


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_decoder_gives_the_windowed_reading_s_text_as_each_token_completes_it(tokenizer, partial_tokens, data):
    """Arbitrary tokens (partial characters, invalid runs, special tokens, ids past the vocabulary),
    in arbitrary steps: the decoder's text after each step and each token is all that decode()
    spells but a trailing unfinished character, and its whole text is the windowed reading's."""
    size = tokenizer.vocab_size
    token = st.one_of(st.sampled_from(partial_tokens), st.integers(0, size - 1), st.integers(0, 16), st.integers(size, size + 8))
    ids = data.draw(st.lists(token, min_size=1, max_size=24))
    cuts = data.draw(st.lists(st.integers(0, 64), max_size=6))
    # At most the detokenizer's context, so that whether it ends inside a character is the prompt's.
    prompt = data.draw(st.lists(token, max_size=5))
    events = _events(ids, cuts)
    texts, tail = stepwise(tokenizer, events, prompt)
    windowed_texts, windowed_tail = stepwise(tokenizer, events, prompt, _WindowedDetokenizer)
    deltas, add_tail = incremental(tokenizer, ids, prompt)
    assert "".join(texts) + tail == "".join(deltas) + add_tail == "".join(windowed_texts) + windowed_tail
    if tokenizer.open_character(prompt):
        return  # the windowed reading's own, held to it above
    assert "".join(texts) + tail == _completed(tokenizer, ids)
    end = 0
    for i, event in enumerate(events):
        end += len(event)
        # No text ends inside a character: each step's is what its tokens complete, no more, no less;
        # the windowed reading may hold some back for later.
        assert "".join(texts[: i + 1]) == _completed(tokenizer, ids[:end])
        assert _completed(tokenizer, ids[:end]).startswith("".join(windowed_texts[: i + 1]))
    # One token at a time (logprobs' text offsets): each token's text as soon as it is complete.
    for i in range(len(ids)):
        assert "".join(deltas[: i + 1]) == _completed(tokenizer, ids[: i + 1])


def test_each_token_s_text_comes_out_as_soon_as_it_is_complete(tokenizer, single_byte_tokens):
    """Invalid bytes, and a U+FFFD the tokens spell whole, are text at once: the windowed reading
    held any text ending in U+FFFD back for the next token."""
    ids = _spelled(tokenizer, single_byte_tokens, [b"\x80", "a", "\ufffd", "🎉", ZHONG[:1], "<|im_end|>", ZHONG[1:2], ZHONG[2:]])
    assert len(ids) == 10 and tokenizer.eos_token_ids[0] in ids  # 🎉 in three tokens, the special token skipped
    assert incremental(tokenizer, ids) == (["\ufffd", "a", "\ufffd", "", "", "🎉", "", "", "", "中"], "")
    assert incremental(tokenizer, ids, detokenizer=_WindowedDetokenizer) == (["", "\ufffda", "", "", "", "\ufffd🎉", "", "", "", "中"], "")


@pytest.mark.parametrize(
    ("prompt_end", "parts", "want"),
    [
        ([ZHONG[:1], ZHONG[1:2]], [ZHONG[2:], " done"], ["", " done"]),
        ([ZHONG[:1], ZHONG[1:2]], ["A"], ["A"]),
        ([PARTY[:1]], [PARTY[1:2], PARTY[2:3], PARTY[3:], " done"], ["", "", "", " done"]),
    ],
)  # fmt: skip
def test_a_prompt_that_ends_inside_a_character_keeps_the_windowed_reading(tokenizer, single_byte_tokens, prompt_end, parts, want):
    """A prompt given as token ids may end inside a character: the character is the prompt's, and
    the output's text starts after it, as the windowed reading has always spelled it."""
    prompt = _spelled(tokenizer, single_byte_tokens, ["ok", *prompt_end])
    ids = _spelled(tokenizer, single_byte_tokens, parts)
    assert incremental(tokenizer, ids, prompt) == incremental(tokenizer, ids, prompt, _WindowedDetokenizer) == (want, "")
    assert stepwise(tokenizer, [ids], prompt) == (["".join(want)], "")


def test_after_flush_the_text_starts_afresh(tokenizer, single_byte_tokens):
    """flush() drops an unfinished character's bytes: a later token cannot complete it."""
    for detokenizer in (IncrementalDetokenizer, _WindowedDetokenizer):
        reader = detokenizer(tokenizer)
        assert reader.extend(_spelled(tokenizer, single_byte_tokens, [ZHONG[:1], ZHONG[1:2]])) + reader.flush() == ""
        assert reader.add(single_byte_tokens[ZHONG[2:]]) + reader.flush() == "\ufffd", detokenizer


SPM_SAMPLES = ["hello world", "Hello  world é ñ", "hello\nworld", " hello", "</s>hello<s>", "ñ日本", ""]


def test_sentencepiece_gguf(tmp_path: Path):
    write_sentencepiece_gguf(tmp_path / "spm.gguf")
    spm = Tokenizer.from_model_path(tmp_path / "spm.gguf")
    assert (spm.bos_token_id, spm.eos_token_ids) == (1, (2,))
    ids = spm.encode("hello world")
    assert ids[0] == 1 and spm.decode(ids) == "hello world"  # BOS by default for this tokenizer type
    # Characters outside the vocabulary fall back to byte tokens, and come back whole.
    assert spm.decode(spm.encode("ñ日本")) == "ñ日本"
    detokenizer = IncrementalDetokenizer(spm, spm.encode("hello"))
    deltas = [detokenizer.add(t) for t in spm.encode(" world ñ", add_special_tokens=False)]
    assert "".join(deltas) + detokenizer.flush() == " world ñ"
    assert not any("\ufffd" in d for d in deltas)
    for text in [*SPM_SAMPLES, " world ñ 日本 hello"]:
        ids = spm.encode(text, add_special_tokens=False)
        for cuts in ([], [1], [2, 3], [1, 2, 3, 4, 5]):
            _extend_matches_add(spm, ids, cuts, spm.encode("hello"))

    transformers = pytest.importorskip("transformers", reason="transformers is the reference tokenizer")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in SPM_SAMPLES:
        assert spm.encode(text) == reference(text)["input_ids"], text


def write_byte_level_gguf(path: Path, pre: str) -> None:
    """A tiny byte-level BPE vocabulary: ChatML control tokens, the 256 byte symbols, a few merges."""
    import gguf
    import numpy as np
    from tokenizers import pre_tokenizers

    controls = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "12 3", "' s"]
    merged = [m.replace(" ", "") for m in merges]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(controls + symbols + merged)
    writer.add_token_types([3] * len(controls) + [1] * (len(symbols) + len(merged)))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(pre == "llama-bpe")
    writer.add_tensor("unused", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe"])
def test_byte_level_gguf_pre_tokenizers_match_transformers(tmp_path: Path, pre):
    write_byte_level_gguf(tmp_path / "bpe.gguf", pre)
    ours = Tokenizer.from_model_path(tmp_path / "bpe.gguf")
    # "12341234" and "IT'S" split differently under the two pre-tokenizers (digit runs of at most
    # three, case-insensitive contractions), so a wrong split shows in the ids.
    texts = ["the 12341234 IT'S it's\n\n  x", "<|im_start|>user\nthe<|im_end|>", "ünïcödé 日本 🎉"]
    for text in texts:
        assert ours.decode(ours.encode(text)) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert (ours.encode("x")[0] == 1) == (pre == "llama-bpe")
    transformers = pytest.importorskip("transformers", reason="transformers is the reference tokenizer")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="bpe.gguf")
    for text in texts:
        assert ours.encode(text) == reference(text)["input_ids"], text


@pytest.mark.parametrize("text", ["Hello 🎉 wörld", "日本語", "a\nb\tc  d"])
def test_token_bytes_spell_the_text_exactly(tokenizer, text):
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == text.encode()


def test_a_token_may_hold_part_of_a_character(tokenizer):
    # SmolLM2 spells 🎉 in three tokens; only their bytes together are a character.
    parts = [tokenizer.token_bytes(t) for t in tokenizer.encode("🎉")]
    assert len(parts) > 1 and b"".join(parts) == "🎉".encode()
    with pytest.raises(UnicodeDecodeError):
        parts[0].decode()


def test_token_bytes_of_special_and_padding_ids(tokenizer):
    assert tokenizer.token_bytes(tokenizer.eos_token_ids[0]) == b"<|im_end|>"
    # A model's embedding may have more rows than the tokenizer has tokens.
    assert tokenizer.token_bytes(tokenizer.vocab_size) == b"" and tokenizer.token_bytes(-1) == b""


def test_sentencepiece_token_bytes(tmp_path: Path):
    write_sentencepiece_gguf(tmp_path / "spm.gguf")
    spm = Tokenizer.from_model_path(tmp_path / "spm.gguf")
    ids = spm.encode(" world ñ日本", add_special_tokens=False)
    assert b"".join(spm.token_bytes(t) for t in ids) == " world ñ日本".encode()


def test_max_token_chars_bounds_the_text_of_any_token(tokenizer):
    longest = max(len(tokenizer.decode([t], skip_special_tokens=False)) for t in range(tokenizer.vocab_size))
    assert tokenizer.max_token_chars >= longest
    text = "#" * (3 * tokenizer.max_token_chars)
    assert len(tokenizer.encode(text)) >= len(text) / tokenizer.max_token_chars
