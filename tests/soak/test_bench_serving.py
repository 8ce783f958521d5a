"""The serving benchmark's workload, arithmetic and report, without a server."""

import json

import pytest

from scripts.bench_serving import PromptTag, bench_prompts, cpu_per_token, parse_args, requests_per_level, server_specs
from scripts.serving_report import (
    BASELINE,
    COUNTER_METRICS,
    OVERHEAD_METRICS,
    OVERLAP,
    SERIAL,
    agreement,
    check_targets,
    level_report,
    loop_run,
    overhead_between,
    side_result,
    write_plot,
)
from scripts.harness.client import CompletionRequest, StreamResult
from scripts.prompts import PromptBuilder


@pytest.fixture(scope="module")
def tokenizer():
    from executor.model import default_model_path
    from tp_runtime.tokenizer import Tokenizer

    return Tokenizer.from_model_path(default_model_path())


def test_every_round_has_prompts_of_its_own_and_the_warm_up_one_of_no_round_s(tokenizer):
    """A --url server keeps its prefix cache from round to round, and a warm-up prompt that is a
    level's own gives that request its pages: no prompt is sent twice."""
    from scripts.bench_serving import round_prompts

    builder, tag = PromptBuilder(tokenizer), PromptTag(tokenizer)
    flags = ["--concurrency", "1", "4", "--input-len", "48", "--seed", "5"]
    prompts = round_prompts(builder, tag, parse_args([*flags, "--rounds", "3"]))
    assert len(prompts.levels) == 3 and all(list(levels) == [1, 4] for levels in prompts.levels)
    sent = [p for levels in prompts.levels for level in levels.values() for p in level] + [prompts.warm]
    assert len(sent) == 3 * (4 + 8) + 1 and len({p[:8] for p in sent}) == len(sent)  # apart from their first tokens
    # The first round's are the prompts a single round sends (the reference's, compared with its outputs).
    assert prompts.levels[0] == round_prompts(builder, tag, parse_args(flags)).levels[0]


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


def test_itl_is_the_gap_before_each_piece_after_the_first_pooled_over_requests(tmp_path, capsys):
    """As vLLM's benchmark reads it: a piece of several tokens (a frame's) is one gap, so the
    bursts that TPOT averages away show."""
    from dataclasses import asdict

    from scripts.bench_serving import PooledRounds
    from scripts.harness.client import _absorb_chunk
    from scripts.serving_report import print_summary

    def streamed(pieces):
        result = StreamResult(t_sent=0.0)
        for now, tokens in pieces:
            _absorb_chunk({"choices": [{"token_ids": tokens, "text": "x"}]}, result, now)
        return result

    burst = streamed([(0.5, [1]), (0.6, [2, 3, 4, 5]), (1.6, [6, 7, 8, 9])])
    steady = streamed([(0.2, [1]), (0.3, [2]), (0.4, [3])])
    assert burst.itl_s == pytest.approx([0.1, 1.0]) and steady.itl_s == pytest.approx([0.1, 0.1])
    assert burst.tpot_s == pytest.approx(1.1 / 8)  # the one-second wait, averaged over eight tokens
    pooled = PooledRounds()
    pooled.add([burst, steady], 2.0, None, None, {}, {})
    side = pooled.run(OVERLAP, 9).side
    assert side.itl_median_s == pytest.approx(0.1) and side.itl_p99_s == pytest.approx(1.0, abs=0.05)
    assert side_result([1], [0.1], [], wall_s=1.0, wanted=1).itl_p99_s is None  # no gap: not measured
    config = {"dtype": "bf16", "input_len": 256, "output_len": 64}
    level = asdict(level_report(32, [loop_run(OVERLAP, side, None)], None, None))
    report = {"target": {"name": "t"}, "config": config, "levels": [level], "targets": [], "load_average": {"start": [0], "end": [0]}}
    print_summary(report, tmp_path)
    header, row = [line for line in capsys.readouterr().err.splitlines() if "TTFT med" in line or line.startswith("  32")]
    assert "ITL p99" in header and row.split()[6] == f"{side.itl_p99_s:.3f}"  # seconds, as TTFT


def _side(wall_s, ttft, tpot):
    return side_result([64] * 4, [ttft] * 4, [tpot] * 4, wall_s=wall_s, wanted=64)


def _overhead(busy, idle, steps=100.0, prefix_queries=16384.0, prefix_hits=0.0):
    before = dict.fromkeys(OVERHEAD_METRICS, 0.0)
    grown = (0.1, 0.2, busy + idle, busy, idle, steps, prefix_queries, prefix_hits)
    return overhead_between(before, dict(zip(COUNTER_METRICS, grown, strict=True)))


def test_ratios_against_the_reference_and_between_the_loops():
    fast, slow = _side(1.0, 0.1, 0.01), _side(3.5, 0.4, 0.04)
    level = level_report(32, [loop_run(OVERLAP, fast, None), loop_run(SERIAL, slow, None)], slow, 1.0)
    assert level.throughput_ratio == 3.5 and level.ttft_ratio == 0.25 and level.tpot_ratio == 0.25
    assert level.overlap_speedup == 4.0 and level.overlap_throughput_gain == 3.5
    alone = level_report(8, [loop_run(OVERLAP, fast, None)], None, None)
    assert alone.throughput_ratio is None and alone.overlap_speedup is None


def test_targets_each_with_its_verdict():
    levels = [
        level_report(32, [loop_run(OVERLAP, _side(1.0, 0.1, 0.01), _overhead(9.9, 0.1))], _side(3.5, 0.4, 0.04), 1.0),
        level_report(1, [loop_run(OVERLAP, _side(1.0, 0.1, 0.0115), _overhead(1.0, 0.1))], _side(1.0, 0.1, 0.01), None),
    ]
    verdicts = {(t["target"].split(" ")[0], t["met"]) for t in check_targets(levels, model_step_s=0.01)}
    assert verdicts == {("tokens/s", True), ("model", True), ("tokens/s", False), ("overlapped", False)}
    assert check_targets(levels[1:], model_step_s=0.0105)[-1]["met"] is False  # 1.095x: over 5%
    assert check_targets(levels[1:], model_step_s=0.011)[-1]["met"] is True
    assert len(check_targets(levels, model_step_s=None)) == 3  # no model step measured: no TPOT target


def test_the_control_cpu_target_sums_every_process_but_the_ranks():
    cpu = {"launcher": 0.05, "frontend": 0.2, "rank0": 9.0, "rank1": 4.0}
    run = loop_run(OVERLAP, _side(1.0, 0.1, 0.01), None, cpu)
    assert run.control_cpu_ms_per_token == 0.25
    verdicts = check_targets([level_report(1, [run], None, None)])
    assert verdicts == [{"target": verdicts[0]["target"], "value": 0.25, "met": True}] and "0.3 ms" in verdicts[0]["target"]
    busy = loop_run(OVERLAP, _side(1.0, 0.1, 0.01), None, cpu)
    assert check_targets([level_report(32, [busy], None, None)])[0]["met"] is False  # 0.25 > 0.05
    assert check_targets([level_report(8, [busy], None, None)]) == []  # no CPU target at 8
    assert loop_run(OVERLAP, _side(1.0, 0.1, 0.01), None).control_cpu_ms_per_token is None


def test_cpu_per_token_from_two_readings():
    assert cpu_per_token({"frontend": 1.0, "rank0": 2.0}, {"frontend": 1.5, "rank0": 4.0, "new": 1.0}, 1000) == {
        "frontend": 0.5, "rank0": 2.0,
    }
    assert cpu_per_token({}, {}, 10) is None and cpu_per_token({"frontend": 1.0}, {"frontend": 2.0}, 0) is None


def test_variants_and_a_baseline_become_servers(tmp_path):
    (tmp_path / "tp_runtime").mkdir()
    (tmp_path / "tp_runtime" / "__main__.py").write_text("")
    args = parse_args(["--loops", "overlap", "--variant", "eager=--enforce-eager --max-num-seqs 4", "--baseline", str(tmp_path)])
    specs = server_specs(args)
    assert list(specs) == [OVERLAP, "eager", BASELINE]
    assert specs["eager"][0].extra_args == ("--async-scheduling", "--enforce-eager", "--max-num-seqs", "4")
    assert specs[BASELINE] == (specs[OVERLAP][0], tmp_path.resolve()) and specs[OVERLAP][1] is None
    for bad in (["--variant", "noflags"], ["--variant", "overlap=--x"], ["--baseline", str(tmp_path / "nope")],
                ["--url", "http://h:1", "--variant", "a=--b"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_overhead_from_counter_growth_or_unavailable():
    overhead = _overhead(busy=9.8, idle=0.2, steps=200.0)
    assert overhead.fraction == pytest.approx(0.03)
    assert overhead.control_plane_share == pytest.approx(0.02) and overhead.model_step_s == pytest.approx(0.049)
    run = loop_run(OVERLAP, _side(1.0, 0.1, 0.01), overhead)
    assert run.control_plane_share == 0.02 and run.model_step_s == 0.049
    assert overhead_between(dict.fromkeys(OVERHEAD_METRICS, 0.0), {"tp_runtime_step_seconds_total": 3.0}) is None
    assert overhead_between(None, dict.fromkeys(OVERHEAD_METRICS, 1.0)) is None


def test_loops_parse_and_a_url_gets_one():
    assert parse_args([]).loops == [OVERLAP, SERIAL]
    assert parse_args(["--loops", "serial"]).loops == [SERIAL]
    assert parse_args(["--url", "http://h:1"]).loops == [OVERLAP]
    with pytest.raises(SystemExit):
        parse_args(["--loops", "overlap,fast"])


def test_agreement_is_the_shared_prefix_share():
    assert agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5
    assert agreement([[1, 2], [5, 6]], [[1, 2], [7, 6]]) == 0.5
    assert agreement([[]], [[1]]) is None


def test_plot_is_a_small_png(tmp_path):
    fast, slow = _side(1.0, 0.1, 0.01), _side(3.5, 0.4, 0.04)
    path = tmp_path / "bench.png"
    levels = [
        level_report(1, [loop_run(OVERLAP, fast, None), loop_run(SERIAL, slow, None)], slow, 1.0),
        level_report(8, [loop_run(OVERLAP, fast, None), loop_run(SERIAL, slow, None)], None, None),
    ]
    write_plot(levels, path)
    assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size < 100_000


def _stream(tokens, t_first, t_last):
    from scripts.harness.client import StreamResult

    return StreamResult(token_ids=list(range(tokens)), t_sent=0.0, t_first=t_first, t_last=t_last)


def test_rounds_pool_every_request_the_walls_the_counters_and_the_cpu():
    from scripts.bench_serving import PooledRounds

    pooled = PooledRounds()
    zero = dict.fromkeys(OVERHEAD_METRICS, 0.0)
    counters = dict(zip(COUNTER_METRICS, (0.1, 0.2, 1.0, 0.9, 0.1, 50.0, 1000.0, 10.0), strict=True))
    pooled.add([_stream(11, 0.1, 1.1)], 2.0, zero, counters, {"frontend": 1.0, "rank0": 5.0}, {"frontend": 1.2, "rank0": 6.0})
    pooled.add([_stream(11, 0.3, 3.3)], 3.0, counters, {k: 2 * v for k, v in counters.items()},
               {"frontend": 1.2, "rank0": 6.0}, {"frontend": 1.5, "rank0": 7.0})  # fmt: skip
    run = pooled.run(OVERLAP, 11)
    assert run.side.requests == 2 and run.side.output_tokens == 22 and run.side.tokens_per_s == 4.4  # 22 / 5 s
    assert run.side.tpot_median_s == pytest.approx(0.2) and run.side.ttft_median_s == pytest.approx(0.2)
    assert run.model_step_s == pytest.approx(1.8 / 100)  # busy seconds over steps, both rounds
    assert run.prefix_hit_share == pytest.approx(0.01)  # hits over lookups, both rounds
    assert run.cpu_ms_per_token == {"frontend": pytest.approx(500 / 22, abs=1e-3), "rank0": pytest.approx(2000 / 22, abs=1e-3)}
    assert run.control_cpu_ms_per_token == pytest.approx(500 / 22, abs=1e-3)


def test_a_round_without_counters_or_processes_leaves_them_out_of_the_pool():
    from scripts.bench_serving import PooledRounds

    pooled = PooledRounds()
    zero = dict.fromkeys(OVERHEAD_METRICS, 0.0)
    pooled.add([_stream(5, 0.1, 0.5)], 1.0, zero, zero, {"frontend": 1.0}, {"frontend": 1.1})
    pooled.add([_stream(5, 0.1, 0.5)], 1.0, None, zero, {}, {})  # a --url server: no /metrics counters, no pids
    run = pooled.run(OVERLAP, 5)
    assert run.model_step_s is None and run.cpu_ms_per_token is None and run.side.requests == 2


def test_the_frontend_threads_cpu_and_wakeups_per_token_pool_over_rounds_or_are_left_out():
    from scripts.bench_serving import PooledRounds
    from scripts.harness.metrics import ThreadReadings

    pooled = PooledRounds()
    zero = dict.fromkeys(OVERHEAD_METRICS, 0.0)
    readings = (
        ThreadReadings({"http": 1.0, "engine-loop": 2.0}, {"http": 100, "engine-loop": 50}),
        ThreadReadings({"http": 1.1, "engine-loop": 2.3}, {"http": 104, "engine-loop": 60}),
        ThreadReadings({"http": 1.2, "engine-loop": 2.4}, {"http": 110, "engine-loop": 62}),
    )
    for before, after in zip(readings, readings[1:]):
        pooled.add([_stream(10, 0.1, 0.5)], 1.0, zero, zero, {}, {})
        pooled.add_threads(before, after)
    run = pooled.run(OVERLAP, 10)
    assert run.thread_cpu_ms_per_token == {
        "http": pytest.approx(200 / 20, abs=1e-3), "engine-loop": pytest.approx(400 / 20, abs=1e-3),
    }  # fmt: skip
    assert run.thread_wakeups_per_token == {"http": pytest.approx(10 / 20), "engine-loop": pytest.approx(12 / 20)}
    pooled.add([_stream(10, 0.1, 0.5)], 1.0, zero, zero, {}, {})
    pooled.add_threads(None, readings[0])  # a round the server did not say: none of them counts
    run = pooled.run(OVERLAP, 10)
    assert run.thread_cpu_ms_per_token is None and run.thread_wakeups_per_token is None


def test_the_frontend_threads_seconds_and_wakeups_are_read_by_name_from_metrics_text():
    from scripts.harness.metrics import ThreadReadings

    text = (
        "# TYPE tp_runtime_thread_cpu_seconds counter\n"
        'tp_runtime_thread_cpu_seconds_total{thread="http"} 1.5\n'
        'tp_runtime_thread_cpu_seconds_total{thread="engine-loop"} 2.25\n'
        "# TYPE tp_runtime_thread_wakeups counter\n"
        'tp_runtime_thread_wakeups_total{thread="http"} 40.0\n'
        "# TYPE tp_runtime_steps counter\n"
        "tp_runtime_steps_total 7.0\n"
    )
    assert ThreadReadings.of(text) == ThreadReadings({"http": 1.5, "engine-loop": 2.25}, {"http": 40.0})
    assert ThreadReadings.of("# TYPE tp_runtime_steps counter\ntp_runtime_steps_total 7.0\n") == ThreadReadings(None, None)


def test_rounds_must_be_at_least_one():
    assert parse_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


def test_sampling_flags_reach_every_request_and_need_no_reference(monkeypatch):
    import asyncio

    import scripts.bench_serving as bench

    args = parse_args(["--temperature", "0.7", "--top-p", "0.9", "--no-reference"])
    assert (args.temperature, args.top_p) == (0.7, 0.9)
    assert (parse_args([]).temperature, parse_args([]).top_p) == (0.0, 1.0)
    for bad in (["--temperature", "0.7"], ["--temperature", "-1", "--no-reference"], ["--top-p", "0", "--no-reference"],
                ["--top-p", "1.5", "--no-reference"], ["--temperature", "1e-6", "--no-reference"],
                ["--top-p", "1e-7", "--no-reference"], ["--logprobs", "21"], ["--logprobs", "-1"]):  # the server's limits (protocol.sampling_limits)
        with pytest.raises(SystemExit):
            parse_args(bad)
    sent = []

    async def fake_stream(client, url, model, request, timeout_s):  # noqa: ANN001 - stream_completion's signature
        sent.append(request)
        return StreamResult()

    monkeypatch.setattr(bench, "stream_completion", fake_stream)
    prompts = [(1, 2, 3), (4, 5, 6), (7, 8, 9)]
    results, _ = asyncio.run(bench.run_server_level("http://h:1", "m", prompts, 2, 5, 1.0, temperature=0.7, top_p=0.9, logprobs=5))
    assert len(results) == 3 and sorted(r.prompt_ids for r in sent) == prompts
    assert {(r.temperature, r.top_p, r.max_tokens, r.ignore_eos) for r in sent} == {(0.7, 0.9, 5, True)}
    assert {(b["temperature"], b["top_p"], b["logprobs"]) for b in (r.body("m") for r in sent)} == {(0.7, 0.9, 5)}
    assert parse_args(["--logprobs", "5"]).logprobs == 5 and "logprobs" not in CompletionRequest((1,), 2).body("m")


def test_the_summary_says_how_the_requests_sampled(tmp_path, capsys):
    from scripts.serving_report import print_summary

    def report(**sampling):
        config = {"dtype": "bf16", "input_len": 256, "output_len": 64, **sampling}
        return {"target": {"name": "t"}, "config": config, "levels": [], "targets": [], "load_average": {"start": [0], "end": [0]}}

    print_summary(report(), tmp_path)
    assert "64 out tokens, greedy" in capsys.readouterr().err
    print_summary(report(temperature=0.7, top_p=0.9), tmp_path)
    assert "64 out tokens, temperature 0.7, top_p 0.9" in capsys.readouterr().err
    print_summary(report(logprobs=5), tmp_path)
    assert "64 out tokens, greedy, 5 alternatives a token" in capsys.readouterr().err


def test_a_level_whose_prompts_the_prefix_cache_served_is_said_to_repeat_them(tmp_path, capsys):
    """A rerun against one server with the same --seed meets its own prompts in the prefix cache:
    less prefill, fewer frames, a lower control CPU a token. The report says so."""
    from dataclasses import asdict

    from scripts.serving_report import print_summary

    fresh = loop_run(OVERLAP, _side(1.0, 0.1, 0.01), _overhead(9.9, 0.1, prefix_hits=16.0))
    repeated = loop_run("baseline", _side(1.0, 0.1, 0.01), _overhead(9.9, 0.1, prefix_hits=10000.0))
    assert fresh.prefix_hit_share == pytest.approx(16 / 16384, abs=1e-4) and repeated.prefix_hit_share == 0.6104
    assert _overhead(9.9, 0.1, prefix_queries=0.0).prefix_hit_share is None  # nothing looked up
    older = overhead_between(dict.fromkeys(OVERHEAD_METRICS, 0.0), dict.fromkeys(OVERHEAD_METRICS, 1.0))
    assert older is not None and older.prefix_hit_share is None  # a tree without the prefix cache's metrics
    config = {"dtype": "bf16", "input_len": 256, "output_len": 64}
    level = asdict(level_report(32, [fresh, repeated], None, None))
    report = {"target": {"name": "t"}, "config": config, "levels": [level], "targets": [], "load_average": {"start": [0], "end": [0]}}
    print_summary(report, tmp_path)
    said = [line for line in capsys.readouterr().err.splitlines() if "prefix cache served" in line]
    assert len(said) == 1 and "baseline: the prefix cache served 61% of the prompt tokens" in said[0]


def _levels_without_servers(monkeypatch, fake_level, warm_up=lambda *a: None, readings=None):  # noqa: ANN001
    """bench_servers' collaborators replaced: no HTTP, no /metrics, no processes; `fake_level`
    stands for run_server_level; each reading of /metrics and of the CPU goes into `readings`."""
    import scripts.bench_serving as bench

    async def no_metrics(url):  # noqa: ANN001
        if readings is not None:
            readings.append(("metrics",))
        return None, None

    def no_cpu(server):  # noqa: ANN001
        if readings is not None:
            readings.append(("cpu",))
        return {}

    monkeypatch.setattr(bench, "served_model", lambda url: "m")
    monkeypatch.setattr(bench, "warm_up", warm_up)
    monkeypatch.setattr(bench, "run_server_level", fake_level)
    monkeypatch.setattr(bench, "_metrics", no_metrics)
    monkeypatch.setattr(bench, "_process_cpu", no_cpu)


def test_each_round_starts_the_servers_afresh_in_alternating_order(monkeypatch, tmp_path):
    """The server started first ran 2-3% slower for as long as it lived, whichever tree it held:
    restarted each round in the other order, every server is first as often. Levels are pooled
    over the rounds, each round's servers measured and stopped before the next round starts."""
    import contextlib

    import scripts.bench_serving as bench

    events: list[tuple] = []

    class FakeServer:
        def __init__(self, options, log_path, env=None, checkout=None):  # noqa: ANN001 - RuntimeServer's signature
            self.name, self.url = log_path.name, f"http://{options}"
            assert env == bench.SERVER_ENV

        def __enter__(self):
            events.append(("start", self.url, self.name))
            return self

        def __exit__(self, *exc):
            events.append(("stop", self.url))

    async def fake_level(url, model, prompts, concurrency, output_len, timeout_s, **sampling):  # noqa: ANN001
        events.append(("level", url, concurrency, prompts[0][0]))
        return [StreamResult(token_ids=[1, 2], finish_reason="length", t_first=0.1, t_last=0.2, t_end=0.2)], 1.0

    monkeypatch.setattr(bench, "RuntimeServer", FakeServer)
    _levels_without_servers(monkeypatch, fake_level, warm_up=lambda *a: events.append(("warm", a[0], a[2])))
    args = parse_args(["--rounds", "2", "--concurrency", "1", "32", "--output-len", "2"])
    specs = {"a": ("A", None), "b": ("B", None)}
    prompts = bench.RoundPrompts(({1: [(1,)], 32: [(2,)]}, {1: [(3,)], 32: [(4,)]}), (9,))
    runs, outputs = bench.bench_servers(lambda round_: bench.started_servers(specs, tmp_path, round_), prompts, args)
    assert events == [
        ("start", "http://A", "server-a.log"), ("start", "http://B", "server-b.log"),
        ("warm", "http://A", (9,)), ("warm", "http://B", (9,)),  # a prompt of no level's
        ("level", "http://A", 1, 1), ("level", "http://B", 1, 1), ("level", "http://B", 32, 2), ("level", "http://A", 32, 2),
        ("stop", "http://B"), ("stop", "http://A"),
        ("start", "http://B", "server-b-round2.log"), ("start", "http://A", "server-a-round2.log"),
        ("warm", "http://A", (9,)), ("warm", "http://B", (9,)),
        # Each round its own prompts, all its servers the same.
        ("level", "http://B", 1, 3), ("level", "http://A", 1, 3), ("level", "http://A", 32, 4), ("level", "http://B", 32, 4),
        ("stop", "http://A"), ("stop", "http://B"),
    ]  # fmt: skip
    assert [[run.loop for run in runs[c]] for c in (1, 32)] == [["a", "b"], ["a", "b"]]
    assert all(run.side.requests == 2 for c in (1, 32) for run in runs[c]), "each server's two rounds pooled"
    assert outputs == {1: [[1, 2]], 32: [[1, 2]]}
    one_level = bench.RoundPrompts(({1: [(1,)]}, {1: [(3,)]}), (9,))
    given = bench.bench_servers(lambda round_: contextlib.nullcontext({"u": ("http://U", None)}), one_level, args)
    assert [run.loop for run in given[0][1]] == ["u"] and not [e for e in events if e[0] == "start" and e[1] == "http://U"]


def test_each_request_s_tpot_is_held_against_the_step_timed_around_its_own_round():
    """A slow spell of the host slows the step and the stream alike: each round's requests are
    divided by that round's step, then pooled; a round without a step adds no ratio."""
    from scripts.bench_serving import PooledRounds

    pooled = PooledRounds()
    pooled.add([_stream(11, 0.1, 1.1), _stream(11, 0.1, 1.2)], 1.0, None, None, {}, {}, model_step_s=0.1)  # TPOT 0.1, 0.11
    pooled.add([_stream(11, 0.1, 2.6)], 1.0, None, None, {}, {}, model_step_s=0.25)  # TPOT 0.25: a slow spell
    pooled.add([_stream(11, 0.1, 9.1)], 1.0, None, None, {}, {})  # not timed around: no ratio
    run = pooled.run(OVERLAP, 11)
    assert run.tpot_over_bench_step == pytest.approx(1.0) and run.bench_steps_s == (0.1, 0.25)  # ratios 1.0, 1.1, 1.0
    assert run.side.tpot_median_s == pytest.approx(0.18)  # TPOT 0.1, 0.11, 0.25, 0.9: every round's, undivided
    untimed = PooledRounds()
    untimed.add([_stream(11, 0.1, 1.1)], 1.0, None, None, {}, {})
    assert untimed.run(OVERLAP, 11).tpot_over_bench_step is None and untimed.run(OVERLAP, 11).bench_steps_s is None


def test_the_tpot_target_takes_the_step_timed_around_the_level_before_the_run_s_one():
    side = _side(1.0, 0.1, 0.0115)
    around = loop_run(OVERLAP, side, None, tpot_over_bench_step=1.02, bench_steps_s=(0.011, 0.0115))
    (verdict,) = check_targets([level_report(1, [around], None, None)], model_step_s=0.01)
    assert verdict["value"] == 1.02 and verdict["met"] is True  # 1.15x against the run's one step
    (verdict,) = check_targets([level_report(1, [loop_run(OVERLAP, side, None)], None, None)], model_step_s=0.01)
    assert verdict["value"] == 1.15 and verdict["met"] is False


def test_the_model_step_is_timed_right_before_and_after_each_server_s_level_at_concurrency_1(monkeypatch):
    import contextlib

    import scripts.bench_serving as bench

    events: list[tuple] = []
    steps = iter([0.010, 0.012, 0.020, 0.022, 0.011, 0.013, 0.014, 0.016])

    def model_step():
        step = next(steps)
        events.append(("step", step))
        return step

    async def fake_level(url, model, prompts, concurrency, output_len, timeout_s, **sampling):  # noqa: ANN001
        events.append(("level", url, concurrency))
        return [StreamResult(token_ids=[1, 2], finish_reason="length", t_first=0.1, t_last=0.122, t_end=0.122)], 1.0

    _levels_without_servers(monkeypatch, fake_level, readings=events)
    args = parse_args(["--rounds", "2", "--concurrency", "1", "8", "--output-len", "2"])
    servers = {"a": ("http://A", None), "b": ("http://B", None)}
    prompts = bench.RoundPrompts(({1: [(1,)], 8: [(2,)]}, {1: [(3,)], 8: [(4,)]}), (9,))
    runs, _ = bench.bench_servers(lambda round_: contextlib.nullcontext(servers), prompts, args, model_step)
    read = [("metrics",), ("cpu",)]

    def level(url, concurrency, *around):  # noqa: ANN001, ANN202
        # The slices fall outside the window in which the server's CPU and /metrics are read.
        inside = [*read, ("level", url, concurrency), *read]
        return [around[0], *inside, around[1]] if around else inside

    assert events == [
        *level("http://A", 1, ("step", 0.010), ("step", 0.012)), *level("http://B", 1, ("step", 0.020), ("step", 0.022)),
        *level("http://B", 8), *level("http://A", 8),  # no step around other levels
        *level("http://B", 1, ("step", 0.011), ("step", 0.013)), *level("http://A", 1, ("step", 0.014), ("step", 0.016)),
        *level("http://A", 8), *level("http://B", 8),
    ]  # fmt: skip
    a, b = runs[1]
    assert a.bench_steps_s == pytest.approx((0.011, 0.015)) and b.bench_steps_s == pytest.approx((0.021, 0.012))
    # TPOT 22 ms in every round: 2.0x and 1.467x for a, 1.048x and 1.833x for b, medians of two.
    assert a.tpot_over_bench_step == pytest.approx((0.022 / 0.011 + 0.022 / 0.015) / 2, abs=1e-3)  # rounded to 3 places, as the target reads it
    assert b.tpot_over_bench_step == pytest.approx((0.022 / 0.021 + 0.022 / 0.012) / 2, abs=1e-3)
    assert all(run.tpot_over_bench_step is None for run in runs[8])


def _probe_command(script: str) -> list[str]:
    import sys

    return [sys.executable, "-c", script]


def test_the_step_probe_asks_for_slices_and_stops_its_process(tmp_path):
    """ModelStepProbe's side of bench_model --slices (tests/model/test_bench_model.py runs that side)."""
    from scripts.bench_serving import SLICE_STEPS, ModelStepProbe

    answer = (
        "import json, sys, time\n"
        "sys.stdout.write('{\"ready\": '); sys.stdout.flush(); time.sleep(0.2)\n"  # a line in two writes
        "print('true}', flush=True)\n"
        "for n, line in enumerate(sys.stdin):\n"
        "    print(json.dumps({'step_s': 0.01 * (n + 1) + int(line) * 1e-6, 'steps': int(line)}), flush=True)\n"
    )
    with ModelStepProbe(_probe_command(answer), tmp_path / "step.log") as probe:
        process = probe.process
        assert probe.step_s() == pytest.approx(0.01 + SLICE_STEPS * 1e-6)
        assert probe.step_s() == pytest.approx(0.02 + SLICE_STEPS * 1e-6)
    assert process.returncode == 0 and probe.slices == pytest.approx([0.01 + SLICE_STEPS * 1e-6, 0.02 + SLICE_STEPS * 1e-6])


def _watched_probe(command_script: str, log_path, **timeouts):  # noqa: ANN001, ANN202
    """A ModelStepProbe running `command_script`, and the list its process goes into when started,
    to see it stopped after the probe fails."""
    from scripts.bench_serving import ModelStepProbe

    started = []

    class Watched(ModelStepProbe):
        def _answer(self, timeout_s):  # noqa: ANN001, ANN202
            if self.process not in started:
                started.append(self.process)
            return super()._answer(timeout_s)

    probe = Watched(_probe_command(command_script), log_path)
    for name, value in timeouts.items():
        setattr(probe, name, value)
    return probe, started


READY = "import json, sys, time\nprint(json.dumps({'ready': True}), flush=True)\n"


@pytest.mark.parametrize(
    ("script", "timeouts", "said"),
    [
        ("import sys; sys.exit('no such model')", {}, "ended .*no such model"),
        ("import sys\nprint('loading...', flush=True)\nsys.stdin.read()\n", {}, "'loading...', not a JSON object"),
        ("import json, sys\nprint(json.dumps({'hello': 1}), flush=True)\nsys.stdin.read()\n", {}, "not its ready line"),
        ("import sys\nsys.stdin.read()\n", {"load_timeout_s": 0.3}, "answered nothing for 0.3 s"),
        # Half a line, then nothing: the read stops at the deadline, not at the line's end.
        ("import sys\nsys.stdout.write('{\"ready\": '); sys.stdout.flush()\nsys.stdin.read()\n", {"load_timeout_s": 0.3},
         "answered nothing for 0.3 s"),
        ("import os, sys\nos.close(1)\nsys.stdin.read()\n", {"stop_timeout_s": 0.3}, "ended its output, still running"),
    ],
    ids=["ends", "not-json", "not-ready", "silent", "half-a-line", "closes-its-output"],
)
def test_a_step_probe_that_does_not_load_is_an_error_and_its_process_is_stopped(tmp_path, script, timeouts, said):
    from scripts.bench_serving import BenchError

    probe, started = _watched_probe(script, tmp_path / "step.log", **timeouts)
    with pytest.raises(BenchError, match=said):
        with probe:
            pytest.fail("a probe that did not load was entered")
    (process,) = started
    assert process.poll() is not None and probe.process is None


@pytest.mark.parametrize(
    ("after_ready", "timeouts", "said"),
    [
        ("sys.stdin.readline()\nprint(json.dumps({'step_s': 0.01, 'steps': 3}), flush=True)\nsys.stdin.read()\n", {}, "to a slice of 40"),
        ("sys.stdin.readline()\nprint(json.dumps({'step_s': 'fast', 'steps': 40}), flush=True)\nsys.stdin.read()\n", {}, "to a slice of 40"),
        ("sys.stdin.readline()\nprint(json.dumps({'step_s': float('inf'), 'steps': 40}), flush=True)\nsys.stdin.read()\n", {},
         "to a slice of 40"),
        ("sys.stdin.read()\n", {"slice_timeout_s": 0.3}, "answered nothing for 0.3 s"),
    ],
    ids=["other-count", "not-a-time", "infinite", "silent"],
)
def test_a_slice_answered_wrongly_or_not_at_all_is_an_error(tmp_path, after_ready, timeouts, said):
    from scripts.bench_serving import BenchError

    probe, started = _watched_probe(READY + after_ready, tmp_path / "step.log", **timeouts)
    with pytest.raises(BenchError, match=said):
        with probe:
            probe.step_s()
    (process,) = started
    assert process.poll() is not None and probe.process is None


def test_a_step_probe_that_ended_after_loading_is_an_error_with_its_log(tmp_path):
    from scripts.bench_serving import BenchError

    # Gone before the slice's line is written: the write meets a closed pipe, and the same error comes.
    probe, started = _watched_probe(READY + "sys.exit('lost the model')\n", tmp_path / "step.log")
    with pytest.raises(BenchError, match="lost the model"):
        with probe:
            probe.process.wait(timeout=30)
            probe.step_s()
    assert started[0].poll() is not None and probe.process is None


def test_a_step_probe_that_does_not_end_with_its_requests_is_killed(tmp_path):
    # It answers, then ignores the end of its stdin; the stop waits stop_timeout_s, then kills it.
    probe, started = _watched_probe(READY + "time.sleep(60)\n", tmp_path / "step.log", stop_timeout_s=0.3)
    with probe:
        pass
    assert started[0].returncode == -9 and probe.process is None


def test_main_times_the_step_around_the_levels_and_stops_the_probe_whatever_happens(monkeypatch, tmp_path):
    import scripts.bench_serving as bench

    probes = []

    class FakeProbe:
        def __init__(self, command, log_path):  # noqa: ANN001 - ModelStepProbe's signature
            self.command, self.slices, self.stopped = command, [], False
            probes.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.stopped = True

        def step_s(self):
            self.slices.append(0.010 + 0.001 * len(self.slices))
            return self.slices[-1]

    def fake_servers(open_round, prompts, args, model_step=None):  # noqa: ANN001
        before, after = model_step(), model_step()
        side = side_result([2], [0.1], [0.0105], 1.0, 2)
        return {1: [loop_run(OVERLAP, side, None, tpot_over_bench_step=1.0, bench_steps_s=((before + after) / 2,))]}, {1: [[1, 2]]}

    monkeypatch.setattr(bench, "ModelStepProbe", FakeProbe)
    monkeypatch.setattr(bench, "bench_servers", fake_servers)
    monkeypatch.setattr(bench, "exit_on_sigterm", lambda: None)  # main's handler would outlive the test
    common = ["--dtype", "bf16", "--weight-format", "dense", "--no-reference", "--output-len", "2"]
    assert bench.main(["--concurrency", "1", *common, "--out", str(tmp_path / "a")]) == 0
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert "--slices" in probes[0].command and probes[0].stopped
    assert report["model_step_slices_s"] == [0.010, 0.011] and report["model_step_s"] == pytest.approx(0.0105)
    assert report["targets"][0]["target"].endswith("step timed around its level") and report["targets"][0]["value"] == 1.0

    def failing_servers(open_round, prompts, args, model_step=None):  # noqa: ANN001
        raise bench.BenchError("a server did not start")

    monkeypatch.setattr(bench, "bench_servers", failing_servers)
    with pytest.raises(bench.BenchError):
        bench.main(["--concurrency", "1", *common, "--out", str(tmp_path / "b")])
    assert probes[1].stopped

    def level_8(open_round, prompts, args, model_step=None):  # noqa: ANN001
        assert model_step is None
        return {8: [loop_run(OVERLAP, side_result([2], [0.1], [0.01], 1.0, 2), None)]}, {8: [[1, 2]]}

    monkeypatch.setattr(bench, "bench_servers", level_8)
    assert bench.main(["--concurrency", "8", *common, "--out", str(tmp_path / "c")]) == 0
    report = json.loads((tmp_path / "c" / "report.json").read_text())
    assert len(probes) == 2 and report["model_step_s"] is None  # no level at 1: no probe
    assert report["model_step_command"].startswith("no level at concurrency 1")


def test_the_summary_says_the_tpot_against_the_step_timed_around_each_level(tmp_path, capsys):
    from dataclasses import asdict

    from scripts.serving_report import print_summary

    run = loop_run(OVERLAP, _side(1.0, 0.1, 0.0102), None, tpot_over_bench_step=1.02, bench_steps_s=(0.0099, 0.0141))
    config = {"dtype": "bf16", "input_len": 256, "output_len": 64}
    report = {
        "target": {"name": "t"}, "config": config, "levels": [asdict(level_report(1, [run], None, None))], "targets": [],
        "load_average": {"start": [0], "end": [0]}, "model_step_s": 0.0105, "model_step_slices_s": [0.0099, 0.0105, 0.0141],
    }  # fmt: skip
    print_summary(report, tmp_path)
    said = capsys.readouterr().err
    assert "bench_model batch-1 step in this run: 10.50 ms median of 3 slices (9.90-14.10)" in said
    assert "overlap: TPOT 1.020x bench_model's batch-1 step timed around its level (9.90-14.10 ms)" in said
