"""The soak's request stream: deterministic, alternating, shared prefixes, every kind of request."""

import pytest

from scripts.prompts import SYSTEM_PROMPTS, PromptBuilder
from scripts.soak_workload import WorkloadShape, build_request, max_request_tokens


@pytest.fixture(scope="module")
def builder():
    from executor.model import default_model_path
    from tp_runtime.tokenizer import Tokenizer

    return PromptBuilder(Tokenizer.from_model_path(default_model_path()))


def test_same_index_and_seed_give_the_same_request(builder):
    shape = WorkloadShape()
    assert build_request(builder, 7, 3, shape) == build_request(builder, 7, 3, shape)
    assert build_request(builder, 7, 3, shape) != build_request(builder, 7, 4, shape)


def test_long_and_short_prompts_alternate_within_their_ranges(builder):
    shape = WorkloadShape(long_tokens=(300, 900), short_tokens=(20, 60))
    template = max(len(builder.chat(s, [])) for s in SYSTEM_PROMPTS) + builder.longest_question
    for i in range(40):
        r = build_request(builder, i, 0, shape)
        assert r.kind == ("long" if i % 2 == 0 else "short")
        low, high = shape.long_tokens if r.kind == "long" else shape.short_tokens
        assert low <= len(r.request.prompt_ids) <= high + template


def test_shared_system_prompts_are_exact_token_prefixes(builder):
    requests = [build_request(builder, i, 1, WorkloadShape()) for i in range(60)]
    by_prompt: dict[int, list] = {}
    for r in requests:
        if r.system_prompt is not None:
            by_prompt.setdefault(r.system_prompt, []).append(r)
    assert len(by_prompt) >= 2, "several shared system prompts must be in use"
    for index, group in by_prompt.items():
        block = builder.system_block(SYSTEM_PROMPTS[index])
        assert len(group) >= 2
        assert all(r.request.prompt_ids[: len(block)] == tuple(block) for r in group)
    assert any(r.system_prompt is None for r in requests)


def test_the_mix_holds_greedy_sampled_and_cancelled_requests(builder):
    requests = [build_request(builder, i, 2, WorkloadShape()) for i in range(200)]
    sampled = [r for r in requests if not r.greedy]
    cancelled = [r for r in requests if r.request.cancel_after_tokens is not None]
    assert 0.1 < len(sampled) / len(requests) < 0.4
    assert 0.05 < len(cancelled) / len(requests) < 0.3
    assert all(r.request.seed is not None and r.request.temperature > 0 for r in sampled)
    assert all(r.request.seed is None for r in requests if r.greedy)
    assert all(1 <= r.request.cancel_after_tokens < r.request.max_tokens for r in cancelled)


def test_max_request_tokens_bounds_every_request(builder):
    shape = WorkloadShape(long_tokens=(50, 120), short_tokens=(5, 10), max_tokens=(4, 9))
    bound = max_request_tokens(builder, shape)
    longest = max(len(r.request.prompt_ids) + r.request.max_tokens for r in (build_request(builder, i, 0, shape) for i in range(100)))
    assert longest <= bound < longest + 100


def test_prompt_body_has_the_exact_length(builder):
    import random

    for length in (1, 17, 333):
        assert len(builder.body(random.Random(length), length)) == length
    with pytest.raises(ValueError, match="at least one token"):
        builder.body(random.Random(0), 0)
