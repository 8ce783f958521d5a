"""docs/grafana-dashboard.json is a Grafana dashboard whose every query names a metric /metrics
exports (with the engine-side histograms set, as the engine will set them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from server.fake_engine import MODEL_NAME, FakeEngine

from tp_runtime.http import ServerSettings, create_app
from tp_runtime.stats import BucketCounter

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
METRIC = re.compile(r"\b(vllm:[a-z0-9_]+|tp_runtime_[a-z0-9_]+)")


def exported_samples(tokenizer) -> set[str]:
    from fastapi.testclient import TestClient

    engine = FakeEngine()
    engine.queue_time = engine.pages_cleared_per_step = BucketCounter((1.0,)).snapshot()
    with TestClient(create_app(engine, tokenizer, ServerSettings((MODEL_NAME,)))) as client:
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        client.post("/v1/completions", json={"prompt": "x", "n": 3})
        text = client.get("/metrics").text
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def test_dashboard_is_grafana_json_with_a_prometheus_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}" and panel["targets"], panel["title"]
        assert all(0 <= panel["gridPos"][k] for k in ("x", "y")) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


def test_every_query_names_an_exported_metric(tokenizer):
    exported = exported_samples(tokenizer)
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel.get("targets", ())
        for name in METRIC.findall(target["expr"])
    }
    assert queried, "the dashboard queries nothing"
    assert queried <= exported, sorted(queried - exported)
    # What issue 17 asks to graph is there.
    for wanted in (
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total", "tp_runtime_kv_offloads_total",
        "tp_runtime_kv_pages_cleared_per_step_bucket",
    ):
        assert wanted in queried, wanted
