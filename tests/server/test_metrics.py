"""/metrics in vLLM's names and shapes, checked against a known workload on the fake engine."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server.fake_engine import MODEL_NAME, FakeEngine

from tp_runtime.http import ServerSettings, create_app
from tp_runtime.http.metrics import size_buckets
from tp_runtime.stats import BucketCounter

LABEL = (("model_name", MODEL_NAME),)


@pytest.fixture
def scrape(tokenizer):
    from fastapi.testclient import TestClient

    engine = FakeEngine()
    with TestClient(create_app(engine, tokenizer, ServerSettings((MODEL_NAME, "other-name")))) as client:

        def read() -> tuple[dict, dict]:
            text = client.get("/metrics").text
            families = {f.name: f for f in text_string_to_metric_families(text)}
            samples = {
                (s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples
            }
            return families, samples

        yield engine, client, read


def test_a_known_workload_in_vllms_names(scrape, tokenizer):
    engine, client, read = scrape
    prompts = ["one two three", "four five", "six"]
    for prompt in prompts:
        assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}).status_code == 200
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "stop here"}], "stop": ["here"]})
    families, samples = read()
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts) + len(engine.submitted[3][0])
    generated = engine.tokens_total  # what the fake streamed

    def value(name, **labels):
        return samples[(name, tuple(sorted({**dict(LABEL), **labels}.items())))]

    assert value("vllm:prompt_tokens_total") == prompt_tokens
    assert value("vllm:generation_tokens_total") == generated
    assert value("vllm:request_success_total", finished_reason="length") == 3
    assert value("vllm:request_success_total", finished_reason="stop") == 1
    # Finished requests only: every timing histogram saw each of the four once.
    for name in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds", "vllm:request_prompt_tokens"):
        assert value(f"{name}_count") == 4, name
    assert value("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert value("vllm:request_generation_tokens_sum") == generated
    # Inter-token gaps: every token after a request's first.
    assert value("vllm:inter_token_latency_seconds_count") == generated - 4
    assert value("vllm:request_time_per_output_token_seconds_count") == 4
    # The fake's scheduler: 6 pages used of 96, none evictable; 5 preemptions; 2 waiting + 1 preempted.
    assert value("vllm:kv_cache_usage_perc") == pytest.approx(6 / 96)
    assert value("vllm:num_preemptions_total") == 5
    assert value("vllm:num_requests_waiting") == 3
    assert value("vllm:num_requests_running") == 0
    assert value("vllm:prefix_cache_queries_total") == prompt_tokens
    assert value("vllm:prefix_cache_hits_total") == 16
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    # The label is the first served name, everywhere.
    assert {s.labels.get("model_name") for f in families.values() if f.name.startswith("vllm:") for s in f.samples} == {MODEL_NAME}


def test_aborted_requests_count_without_latencies(scrape):
    engine, client, read = scrape
    engine.fail_after = 1
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5})
    _, samples = read()
    assert samples[("vllm:request_success_total", (("finished_reason", "error"), *LABEL))] == 1
    assert samples[("vllm:e2e_request_latency_seconds_count", LABEL)] == 0


def test_engine_side_histograms_appear_once_the_engine_times_them(scrape):
    engine, _, read = scrape
    families, _ = read()
    assert "vllm:request_queue_time_seconds" not in families
    assert "tp_runtime_kv_pages_cleared_per_step" not in families
    queue, cleared = BucketCounter((0.1, 1.0)), BucketCounter((1, 8, 64))
    for seconds in (0.05, 0.5, 0.7, 3.0):
        queue.observe(seconds)
    for pages in (0, 3, 8, 100):
        cleared.observe(pages)
    engine.queue_time, engine.pages_cleared_per_step = queue.snapshot(), cleared.snapshot()
    _, samples = read()
    assert samples[("vllm:request_queue_time_seconds_bucket", (("le", "0.1"), *LABEL))] == 1
    assert samples[("vllm:request_queue_time_seconds_bucket", (("le", "1.0"), *LABEL))] == 3
    assert samples[("vllm:request_queue_time_seconds_count", LABEL)] == 4
    assert samples[("vllm:request_queue_time_seconds_sum", LABEL)] == pytest.approx(4.25)
    assert samples[("tp_runtime_kv_pages_cleared_per_step_bucket", (("le", "8.0"),))] == 3
    assert samples[("tp_runtime_kv_pages_cleared_per_step_bucket", (("le", "+Inf"),))] == 4


def test_help_texts_say_what_is_counted(scrape):
    _, _, read = scrape
    families, _ = read()
    assert "requests" in families["tp_runtime_kv_offloads"].documentation.lower()
    assert "requests" in families["tp_runtime_kv_restores"].documentation.lower()
    assert "pages" in families["tp_runtime_kv_pages_offloaded"].documentation.lower()
    assert "pages" in families["tp_runtime_kv_pages_restored"].documentation.lower()


def test_pages_offloaded_and_restored_are_pages_not_requests(scrape):
    _, _, read = scrape
    _, samples = read()
    # The fake's scheduler: 8 requests offloaded with 40 pages, 7 restored with 33.
    assert (samples[("tp_runtime_kv_offloads_total", ())], samples[("tp_runtime_kv_pages_offloaded_total", ())]) == (8, 40)
    assert (samples[("tp_runtime_kv_restores_total", ())], samples[("tp_runtime_kv_pages_restored_total", ())]) == (7, 33)


def test_bucket_counter_is_prometheus_le():
    counter = BucketCounter((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 2.0, 9.0):
        counter.observe(value)
    snapshot = counter.snapshot()
    assert snapshot.counts == (2, 2, 1) and snapshot.count == 5
    assert snapshot.cumulative() == [(1.0, 2), (2.0, 4), (float("inf"), 5)]
    with pytest.raises(ValueError):
        BucketCounter((2.0, 1.0))


def test_size_buckets_are_vllms_1_2_5():
    assert size_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert size_buckets(256)[-1] == 200


def test_each_thread_has_its_cpu_time_by_name(scrape):
    # Two threads of one name that burn a known amount of their own CPU are one series with at
    # least their sum, while they are still alive to be read.
    import threading
    import time

    _, _, read = scrape
    done = threading.Event()
    spent: list[float] = []
    burnt = threading.Barrier(3)

    def burn() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.05:
            pass
        spent.append(time.thread_time() - start)
        burnt.wait(10)
        done.wait(10)

    workers = [threading.Thread(target=burn, name="cpu-burner") for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        burnt.wait(10)
        families, samples = read()
    finally:
        done.set()
        for worker in workers:
            worker.join(10)
    burners = [s for s in families["tp_runtime_thread_cpu_seconds"].samples if s.labels == {"thread": "cpu-burner"}]
    assert len(burners) == 1 and burners[0].value >= sum(spent)
    assert samples[("tp_runtime_thread_cpu_seconds_total", (("thread", "MainThread"),))] > 0


def test_each_thread_has_its_wakeups_by_name(scrape):
    # A thread that waits for a turn and is woken for it, turn after turn, counts a wake-up each.
    import threading

    _, _, read = scrape
    turns = 20
    go, back = threading.Event(), threading.Event()

    def player() -> None:
        for _ in range(turns + 1):  # the last turn is the end, once the counts are read
            if not go.wait(10):
                return
            go.clear()
            back.set()

    def woken() -> float:
        families, _ = read()
        return next(s.value for s in families["tp_runtime_thread_wakeups"].samples if s.labels == {"thread": "player"})

    worker = threading.Thread(target=player, name="player")
    worker.start()
    try:
        before = woken()
        for _ in range(turns):
            go.set()
            assert back.wait(10)
            back.clear()
        after = woken()
    finally:
        go.set()
        worker.join(10)
    assert after - before >= turns // 2


def test_the_request_histograms_expose_what_prometheus_clients_histogram_would():
    # The HTTP thread's histograms are plain bucket counts; a dashboard reads the same series as
    # from prometheus_client's Histogram of the same name and buckets (its _created aside), the
    # bounds spelled alike ("1e+06") up to a context of two million tokens.
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from tp_runtime.http.metrics import RequestHistograms

    max_model_len = 2_000_000
    values = [0.0, 0.01, 0.0100001, 0.3, 0.42, 79.9, 80.0, 81.0, 1e6, 1e9]
    ours = RequestHistograms(MODEL_NAME, max_model_len)
    theirs = CollectorRegistry()
    for name, help_text, counter in ours.exposed:
        reference = Histogram(
            name, help_text, ("model_name",), buckets=counter.snapshot().bounds, registry=theirs
        ).labels(MODEL_NAME)
        for v in values:
            counter.observe(v)
            reference.observe(v)
    mine = CollectorRegistry()
    mine.register(ours)

    def series(registry) -> dict:
        families = text_string_to_metric_families(generate_latest(registry).decode())
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in families for s in f.samples if not s.name.endswith("_created")
        }

    assert series(mine) == series(theirs)
    assert series(mine)[("vllm:request_prompt_tokens_bucket", (("le", "1e+06"), *LABEL))] == 9
    assert series(mine)[("vllm:inter_token_latency_seconds_count", LABEL)] == len(values)


def test_every_counter_the_serving_benchmark_reads_is_here_by_its_name(scrape):
    """bench_serving reads these by name (scripts/serving_report.py); a name it misspells would
    read as missing, and its columns as unavailable, without an error."""
    from scripts.harness.metrics import parse_metrics
    from scripts.serving_report import COUNTER_METRICS

    engine, client, read = scrape
    values = parse_metrics(client.get("/metrics").text)
    assert [name for name in COUNTER_METRICS if name not in values] == []
    assert values["vllm:prefix_cache_hits_total"] == engine.stats().prefix_cache_hits_total
