"""scripts/bench_interference.py: what it reads from each round's streams."""

import math

import pytest

from scripts.bench_interference import parse_args, summarize, variants_of
from scripts.harness.client import StreamResult


def stream(times: list[float], finish_reason: str | None = "length", t_sent: float = 0.0) -> StreamResult:
    result = StreamResult(finish_reason=finish_reason, t_sent=t_sent, t_first=times[0] if times else None)
    result.token_times.extend(times)
    return result


def test_a_piece_of_several_tokens_is_one_arrival() -> None:
    # Tokens of one piece share its arrival time: the gap is between pieces, not tokens.
    assert stream([1.0, 1.0, 1.0, 1.5, 3.5]).itl_s == [0.5, 2.0]
    assert stream([]).itl_s == []


def test_a_round_reports_the_median_stream_stall_the_gap_p99_and_the_long_prompts_ttft() -> None:
    streams = [stream([0.0, 0.1, 0.2, 1.2]), stream([0.0, 0.1, 2.1]), stream([0.0, 0.5])]
    long = stream([4.0], t_sent=1.0)
    r = summarize("budget512", 0, streams, long)
    assert r.stream_longest_gap_s == 1.0  # longest gaps 1.0, 2.0, 0.5: their median
    assert r.gap_p99_s == 2.0
    assert r.long_ttft_s == 3.0
    assert r.failed == ()


def test_a_request_that_did_not_complete_fails_the_round() -> None:
    r = summarize("x", 1, [stream([0.0, 1.0], finish_reason=None)], stream([], finish_reason=None))
    assert len(r.failed) == 2 and math.isnan(r.long_ttft_s)


def test_variants_default_to_the_two_budgets_and_take_name_equals_flags() -> None:
    assert variants_of(parse_args([])) == {
        "budget512": ("--max-num-batched-tokens", "512"),
        "budget2048": ("--max-num-batched-tokens", "2048"),
    }
    assert variants_of(parse_args(["--variant", "plain=", "--variant", "eager=--enforce-eager"])) == {
        "plain": (),
        "eager": ("--enforce-eager",),
    }
    with pytest.raises(SystemExit):
        variants_of(parse_args(["--variant", "no-equals-sign"]))
