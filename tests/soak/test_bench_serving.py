"""The serving benchmark's workload, arithmetic and report, without a server."""

import pytest

from scripts.bench_serving import (
    OVERHEAD_METRICS,
    PromptTag,
    agreement,
    bench_prompts,
    check_targets,
    level_report,
    overhead_between,
    requests_per_level,
    side_result,
    write_plot,
)
from scripts.prompts import PromptBuilder


@pytest.fixture(scope="module")
def tokenizer():
    from executor.model import default_model_path
    from tp_runtime.tokenizer import Tokenizer

    return Tokenizer.from_model_path(default_model_path())


def test_prompts_have_the_exact_length_and_distinct_beginnings(tokenizer):
    builder, tag = PromptBuilder(tokenizer), PromptTag(tokenizer)
    prompts = bench_prompts(builder, tag, 12, 64, seed=0, offset=100)
    assert all(len(p) == 64 for p in prompts)
    first_page = {p[:16] for p in prompts}
    assert len(first_page) == 12, "no two prompts may share a first KV page (prefix caching)"
    assert prompts == bench_prompts(builder, tag, 12, 64, seed=0, offset=100)
    with pytest.raises(ValueError, match="too short"):
        bench_prompts(builder, tag, 1, 2, seed=0, offset=0)


def test_two_waves_per_level_unless_fixed():
    assert [requests_per_level(c, None) for c in (1, 8, 32)] == [4, 16, 64]
    assert requests_per_level(32, 5) == 5


def test_side_result_counts_throughput_and_short_outputs():
    side = side_result([64, 64, 60], [0.1, 0.2, 0.3], [0.01, 0.02], wall_s=2.0, wanted=64)
    assert side.output_tokens == 188 and side.tokens_per_s == 94.0 and side.short_outputs == 1
    assert side.ttft_median_s == 0.2 and side.tpot_median_s == pytest.approx(0.015)


def test_ratios_and_targets():
    fast = side_result([64] * 4, [0.1] * 4, [0.01] * 4, wall_s=1.0, wanted=64)
    slow = side_result([64] * 4, [0.4] * 4, [0.04] * 4, wall_s=3.5, wanted=64)
    levels = [level_report(32, fast, slow, None, 1.0), level_report(1, fast, side_result([64] * 4, [0.1] * 4, [0.01] * 4, 1.0, 64), None, None)]
    assert levels[0].throughput_ratio == 3.5 and levels[0].ttft_ratio == 0.25 and levels[0].tpot_ratio == 0.25
    targets = check_targets(levels)
    assert targets == [
        {"concurrency": 32, "min_ratio": 3.0, "ratio": 3.5, "met": True},
        {"concurrency": 1, "min_ratio": 1.5, "ratio": 1.0, "met": False},
    ]
    assert level_report(8, fast, None, None, None).throughput_ratio is None


def test_overhead_from_counter_growth_or_unavailable():
    before = dict(zip(OVERHEAD_METRICS, (1.0, 2.0, 10.0)))
    after = dict(zip(OVERHEAD_METRICS, (1.5, 2.5, 30.0)))
    overhead = overhead_between(before, after)
    assert overhead.fraction == pytest.approx(0.05)
    assert overhead_between(before, {"tp_runtime_step_seconds_total": 3.0}) is None
    assert overhead_between(None, after) is None


def test_agreement_is_the_shared_prefix_share():
    assert agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5
    assert agreement([[1, 2], [5, 6]], [[1, 2], [7, 6]]) == 0.5
    assert agreement([[]], [[1]]) is None


def test_plot_is_a_small_png(tmp_path):
    fast = side_result([64] * 4, [0.1] * 4, [0.01] * 4, wall_s=1.0, wanted=64)
    slow = side_result([64] * 4, [0.4] * 4, [0.04] * 4, wall_s=3.5, wanted=64)
    path = tmp_path / "bench.png"
    write_plot([level_report(1, fast, slow, None, 1.0), level_report(8, fast, None, None, None)], path, "tp-runtime")
    assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size < 100_000
