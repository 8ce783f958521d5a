"""The OpenAI parameters of issue 17 against the real runtime, at TP=1 and TP=2 on the CPU, through
the official openai client: penalties, min_tokens and logit bias give the same greedy tokens at
both sizes; alternatives are the sampled row's most likely tokens; n choices equal n single
requests with seeds seed, seed+1, ...; and /metrics counts a known workload. The servers are the
session's shared pair (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.e2e.serving import Server

PROMPTS = ("Hello there", "The quick brown fox", "1, 2, 3, 4,")
PENALTIES = {"presence_penalty": 0.8, "frequency_penalty": 0.6}
EXTRA_PENALTIES = {"repetition_penalty": 1.3, "ignore_eos": True, "return_token_ids": True}


def served(server: Server) -> str:
    """The model's name on the API: its --model path as given (no --served-model-name)."""
    assert server.options.model is not None
    return server.options.model


def api(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def greedy_ids(server: Server, prompt: str, max_tokens: int = 20, **kwargs) -> list[int]:
    extra = {"ignore_eos": True, "return_token_ids": True, **kwargs.pop("extra_body", {})}
    result = api(server).completions.create(
        model=served(server), prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra, **kwargs
    )
    return result.choices[0].token_ids


def test_penalties_and_logit_bias_give_the_same_greedy_tokens_at_tp1_and_tp2(
    tiny_model: Path, server_tp1: Server, server_tp2: Server
) -> None:
    from tp_runtime.tokenizer import Tokenizer

    # The tiny model's logits are wider than its tokenizer's vocabulary; logit_bias takes tokens.
    vocab = Tokenizer.from_model_path(tiny_model).vocab_size
    changed = 0
    for prompt in PROMPTS:
        plain = greedy_ids(server_tp1, prompt)
        penalized = greedy_ids(server_tp1, prompt, extra_body=EXTRA_PENALTIES, **PENALTIES)
        changed += penalized != plain
        # The plain output's most frequent token, biased away, never comes; biased up, it is all there is.
        common = max((t for t in set(plain) if t < vocab), key=plain.count)
        both = {**PENALTIES, "logit_bias": {str(common): -100}, "extra_body": EXTRA_PENALTIES}
        at_tp1 = greedy_ids(server_tp1, prompt, **both)
        assert common not in at_tp1 and greedy_ids(server_tp2, prompt, **both) == at_tp1, prompt
        assert greedy_ids(server_tp2, prompt, max_tokens=4, logit_bias={str(common): 100}) == [common] * 4
    assert changed, "the penalties changed no greedy output"


def test_min_tokens_holds_a_stop_token_back_at_both_sizes(server_tp1: Server, server_tp2: Server) -> None:
    prompt = PROMPTS[1]
    first = greedy_ids(server_tp1, prompt)[0]
    stopped = api(server_tp1).completions.create(
        model=served(server_tp1), prompt=prompt, max_tokens=12, temperature=0,
        extra_body={"stop_token_ids": [first], "return_token_ids": True},
    )
    assert stopped.choices[0].token_ids == [first] and stopped.choices[0].finish_reason == "stop"
    held = {
        server.url: api(server).completions.create(
            model=served(server), prompt=prompt, max_tokens=12, temperature=0,
            extra_body={"stop_token_ids": [first], "min_tokens": 5, "return_token_ids": True},
        ).choices[0].token_ids
        for server in (server_tp1, server_tp2)
    }
    tokens = held[server_tp1.url]
    assert held[server_tp2.url] == tokens and len(tokens) >= 5 and first not in tokens[:5]


@pytest.mark.parametrize("stream", [False, True])
def test_alternatives_are_the_rows_most_likely_tokens(server_tp1: Server, server_tp2: Server, stream: bool) -> None:
    messages = [{"role": "user", "content": "Hi"}]

    def content(server: Server) -> list:
        result = api(server).chat.completions.create(
            model=served(server), messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5,
            stream=stream, extra_body={"ignore_eos": True},
        )
        if not stream:
            return result.choices[0].logprobs.content
        return [t for c in result if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]

    entries = content(server_tp1)
    assert len(entries) == 6
    for entry in entries:
        tops = entry.top_logprobs
        assert len(tops) == 5 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        # Greedy: the sampled token is the most likely one, with the same logprob.
        assert (tops[0].token, tops[0].bytes) == (entry.token, entry.bytes)
        assert tops[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
    at_tp2 = content(server_tp2)
    assert [e.token for e in at_tp2] == [e.token for e in entries]
    for mine, theirs in zip(entries, at_tp2, strict=True):
        assert [t.logprob for t in theirs.top_logprobs] == pytest.approx([t.logprob for t in mine.top_logprobs], abs=1e-4)
    completion = api(server_tp1).completions.create(
        model=served(server_tp1), prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = completion.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == pytest.approx(logprob) and max(top.values()) == pytest.approx(logprob)


def test_n_choices_are_the_single_requests_with_successive_seeds(server_tp1: Server, server_tp2: Server) -> None:
    body = {"model": served(server_tp1), "prompt": PROMPTS[2], "max_tokens": 10, "temperature": 1.0, "seed": 7}
    extra = {"ignore_eos": True}
    result = api(server_tp1).completions.create(n=3, extra_body=extra, **body)
    assert [c.index for c in result.choices] == [0, 1, 2]
    singles = [
        api(server_tp1).completions.create(extra_body=extra, **{**body, "seed": 7 + i}).choices[0].text for i in range(3)
    ]
    assert [c.text for c in result.choices] == singles
    assert len(set(singles)) > 1, "three seeds sampled the same text"
    prompt_tokens = api(server_tp1).completions.create(extra_body=extra, **body).usage.prompt_tokens
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (prompt_tokens, 30)
    assert [c.text for c in api(server_tp2).completions.create(n=3, extra_body=extra, **body).choices] == singles
    streamed = ["", "", ""]
    for chunk in api(server_tp2).completions.create(n=3, stream=True, extra_body=extra, **body):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == singles


def _stop_char(text: str) -> int | None:
    """The index of a character of text that does not come earlier in it (nor is a piece of one)."""
    return next((i for i in range(1, len(text)) if text[i] not in text[:i] and text[i] != "\ufffd"), None)


def test_a_choice_ended_by_a_stop_string_leaves_its_siblings_running(server_tp1: Server) -> None:
    """Choice 0 leads the prompt's pages; ending it early must not take them from the others."""
    body = {"model": served(server_tp1), "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    # The tiny model's random weights write text only now and then: a seed whose first sample has some.
    for seed in range(20):
        alone = api(server_tp1).completions.create(**body, seed=seed).choices[0].text
        cut = _stop_char(alone)
        if cut is not None:
            break
    assert cut is not None, "no seed gave a text to stop in"
    stop = alone[cut]
    result = api(server_tp1).completions.create(n=3, stop=[stop], seed=seed, **body)
    assert result.choices[0].text == alone[:cut] and result.choices[0].finish_reason == "stop"
    for i, choice in enumerate(result.choices[1:], start=1):
        single = api(server_tp1).completions.create(stop=[stop], seed=seed + i, **body).choices[0]
        assert (choice.text, choice.finish_reason) == (single.text, single.finish_reason)


def test_metrics_count_a_known_workload(server_tp1: Server) -> None:
    before = server_tp1.settled_metrics()
    prompt = "A prompt long enough to fill two pages of sixteen tokens each, and then some more."
    usages = [
        api(server_tp1).completions.create(
            model=served(server_tp1), prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        ).usage
        for _ in range(2)
    ]
    after = server_tp1.settled_metrics(since=before)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt_len = usages[0].prompt_tokens
    assert prompt_len >= 32
    assert delta("vllm:prompt_tokens_total") == 2 * prompt_len
    assert delta("vllm:generation_tokens_total") == 10
    assert delta("vllm:request_success_total") == 2
    for histogram in (
        "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
        "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens",
    ):
        assert delta(f"{histogram}_count") == 2, histogram
    # One observation per token event, as vLLM's is per engine step that brings a request tokens:
    # each request's prompt step brings its first token, one frame of four forwards the others.
    assert delta("vllm:inter_token_latency_seconds_count") == 2
    assert delta("tp_runtime_model_forwards_total") == 2 * 5
    assert delta("vllm:request_prompt_tokens_sum") == 2 * prompt_len
    assert delta("vllm:request_generation_tokens_sum") == 10
    # The second request finds the first one's whole pages in the prefix cache.
    assert delta("vllm:prefix_cache_queries_total") == 2 * prompt_len
    assert delta("vllm:prefix_cache_hits_total") == 16 * ((prompt_len - 1) // 16)
    assert delta("tp_runtime_kv_pages_cleared_per_step_count") == delta("tp_runtime_steps_total") > 0
    assert 0 <= after["vllm:kv_cache_usage_perc"] <= 1
    assert delta("vllm:num_preemptions_total") == 0


def test_metrics_count_preemptions_and_offloaded_pages_under_pressure(tiny_model: Path) -> None:
    """Four requests of 6 pages each in a pool of 12: the scheduler must preempt, and with host
    memory it offloads; the metrics count requests and pages apart, and agree with each other."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    options = (
        "--dtype", "fp32", "--num-kv-pages", "12", "--max-model-len", "128", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "128", "--swap-space", "1MiB",
    )  # fmt: skip
    server = Server(tiny_model, tp=1, extra=options)
    try:
        before = server.metrics()
        prompt = "pressure " * 4  # 36 tokens or so, 3 pages; 48 more tokens make 6
        clients = [api(server) for _ in range(4)]
        # All four at once: on a loaded machine a client made in its thread came late enough for the
        # first requests to finish before it, and nothing was preempted.
        together = threading.Barrier(4, timeout=60)

        def one(i: int) -> int:
            together.wait()
            result = clients[i].completions.create(
                model=served(server), prompt=f"{i} {prompt}", max_tokens=48, temperature=0, extra_body={"ignore_eos": True}
            )
            return result.usage.completion_tokens

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(one, range(4))) == [48] * 4
        after = server.metrics()
    finally:
        server.stop()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    preemptions = delta("vllm:num_preemptions_total")
    assert preemptions > 0 and delta("tp_runtime_preemptions_total") == preemptions
    offloads, pages = delta("tp_runtime_kv_offloads_total"), delta("tp_runtime_kv_pages_offloaded_total")
    assert 0 < offloads <= preemptions and pages >= offloads, (offloads, pages)
    restores, restored = delta("tp_runtime_kv_restores_total"), delta("tp_runtime_kv_pages_restored_total")
    # Every offloaded request came back (all four finished), with the pages it took out.
    assert restores == offloads and restored == pages, (restores, restored, offloads, pages)
    assert delta("vllm:generation_tokens_total") == 4 * 48
