"""Rank 0's grammar masks: applied where sampling happens, rebuilt from the output sent whole again
(after a preemption by recompute, an ABORT or a restart), advanced by the fed-back token, and never
one token stale; min_p."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from executor.grammar import GrammarEngine, GrammarVocabulary, forbidden_tokens, new_bitmask
from executor.sampler import LogitsProcessing, SamplingBatch, sample
from executor.sampling_state import SamplingStates
from protocol.grammar import GrammarKind, GrammarSpec
from tests.executor.test_logits_processing import prepare_with_state
from tests.tiny_models import write_tiny_llama
from tp_runtime.tokenizer import Tokenizer

VOCAB = 512
ALTERNATING = GrammarSpec(GrammarKind.REGEX, "([0-9][a-z]){4}")


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_model_path(write_tiny_llama(Path(tmp_path_factory.mktemp("tiny")), vocab_size=VOCAB))


@pytest.fixture(scope="module")
def engine(tiny_tokenizer) -> GrammarEngine:
    vocabulary = GrammarVocabulary(tiny_tokenizer.backend_json(), tuple(tiny_tokenizer.eos_token_ids))
    return GrammarEngine(lambda: vocabulary, VOCAB)


def allowed(engine: GrammarEngine, matcher) -> set[int]:
    bitmask = new_bitmask(1, VOCAB)
    matcher.fill(bitmask, 0)
    return set(torch.nonzero(~forbidden_tokens(bitmask, VOCAB, "cpu")[0]).squeeze(1).tolist())


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_mask_one_token_stale_would_allow_an_invalid_token(engine, tiny_tokenizer):
    """The property the overlap test relies on: after "1" only letters may come, and the mask from
    before "1" (digits) would allow a digit there."""
    matcher = engine.build(ALTERNATING.encode(), [])
    before = allowed(engine, matcher)
    digit, letter = ids(tiny_tokenizer, "1")[0], ids(tiny_tokenizer, "a")[0]
    assert digit in before and letter not in before
    matcher.consume(digit)
    after = allowed(engine, matcher)
    assert letter in after and digit not in after


def grammar_fields(spec: GrammarSpec, history: list[int], prompt_len: int = 0) -> dict:
    data = np.frombuffer(spec.encode(), dtype=np.uint8)
    return dict(
        sampling_state=np.array([1, 0], dtype=np.uint8),
        grammar_lens=np.array([data.shape[0], 0], dtype=np.int32),
        grammar=data,
        history_lens=np.array([len(history), 0], dtype=np.int32),
        history_prompt_lens=np.array([prompt_len, 0], dtype=np.int32),
        history=np.array(history, dtype=np.int32),
    )


def test_the_mask_follows_the_output_and_is_rebuilt_from_it(engine, tiny_tokenizer):
    states = SamplingStates(engine)
    digit, letter = ids(tiny_tokenizer, "7")[0], ids(tiny_tokenizer, "q")[0]
    first = prepare_with_state(**grammar_fields(ALTERNATING, []))
    states.prefetch(first)
    states.begin(first, {})
    logits = torch.zeros(2, VOCAB)
    logits[:, digit] = 5.0
    logits[:, letter] = 4.0
    out = sample(logits, _greedy(2, states.processing(first, "cpu")))
    assert out.token_ids.tolist() == [digit, digit]  # row 1 has no grammar
    states.append(first.seq_ids, out.token_ids.numpy(), out.finite.numpy())

    # Held: the next row must be a letter though the model prefers the digit.
    second = prepare_with_state(sampling_state=np.array([2, 0], dtype=np.uint8))
    states.begin(second, {})
    assert sample(logits, _greedy(2, states.processing(second, "cpu"))).token_ids.tolist() == [letter, digit]

    # Sent whole again with the output so far (a preemption by recompute) and a fed-back token
    # the scheduler did not know: the rebuilt matcher stands where the held one would.
    third = prepare_with_state(**grammar_fields(ALTERNATING, [11, 12, digit], prompt_len=2), feedback=np.array([1, 0], dtype=np.uint8))
    states.prefetch(third)
    states.begin(third, {0: letter})
    assert states.output_of(7) == [digit, letter]
    assert sample(logits, _greedy(2, states.processing(third, "cpu"))).token_ids.tolist() == [digit, digit]


def test_a_finished_grammar_allows_only_the_end(engine, tiny_tokenizer):
    matcher = engine.build(GrammarSpec(GrammarKind.CHOICE, json.dumps(["yes"])).encode(), ids(tiny_tokenizer, "yes"))
    assert allowed(engine, matcher) == set(tiny_tokenizer.eos_token_ids)


def test_json_schema_output_stays_valid_under_random_sampling(engine, tiny_tokenizer):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}, "c": {"enum": ["red", "green"]}},
        "required": ["n", "ok", "c"],
        "additionalProperties": False,
    }
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        matcher = engine.build(spec.encode(), [])
        text = []
        for _ in range(80):
            bitmask = new_bitmask(1, VOCAB)
            matcher.fill(bitmask, 0)
            logits = torch.randn(VOCAB, generator=generator).masked_fill(forbidden_tokens(bitmask, VOCAB, "cpu")[0], float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
            if token in tiny_tokenizer.eos_token_ids:
                break
            matcher.consume(token)
            text.append(token)
        data = json.loads(tiny_tokenizer.decode(text))
        assert set(data) == {"n", "ok", "c"} and data["c"] in ("red", "green")


def test_min_p_keeps_only_tokens_near_the_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(200, 1)
    proc = LogitsProcessing(
        **{name: torch.zeros(0, dtype=torch.long) for name in (
            "bias_rows", "bias_ids", "banned_rows", "banned_ids", "penalty_rows", "prompt_rows", "prompt_ids",
            "output_rows", "output_ids")},
        bias_values=torch.zeros(0), presence=torch.zeros(0), frequency=torch.zeros(0), repetition=torch.zeros(0),
        min_p_rows=torch.arange(100), min_p=torch.full((100,), 0.5),
    )
    out = sample(logits, SamplingBatch.of(np.ones(200), np.ones(200), np.zeros(200), np.arange(200), np.zeros(200), processing=proc))
    drawn = out.token_ids.tolist()
    assert set(drawn[:100]) <= {0, 1}  # 0.15 and 0.05 are under half of 0.5
    assert {2, 3} & set(drawn[100:])  # the rows without min_p still reach them


def _greedy(rows: int, processing) -> SamplingBatch:
    return SamplingBatch.of(np.zeros(rows), np.ones(rows), np.zeros(rows), np.full(rows, -1), np.zeros(rows), processing=processing)
