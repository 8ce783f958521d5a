"""The HTTP fuzzer (http_fuzz.py) against the app with the fake engine: no answer is a 5xx, every
error is JSON, nothing that slips past the edge reaches the engine (the fake raises
WireLimitViolation, a 500, for any value the wire cannot carry), and afterwards the server is
healthy and gives the same greedy text as before."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from server.fake_engine import MODEL_NAME, FakeEngine

from scripts.harness.http_fuzz import CASES, check_answer, edge_grid, greedy_text, send
from tp_runtime.http import ServerSettings, create_app


def test_no_request_takes_the_server_down(tokenizer):
    from fastapi.testclient import TestClient

    engine = FakeEngine()
    app = create_app(engine, tokenizer, ServerSettings((MODEL_NAME,)))
    with TestClient(app, raise_server_exceptions=False) as client:
        before = greedy_text(client)

        @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(case=CASES)
        def one(case) -> None:
            check_answer(case, send(client, case))

        one()
        assert client.get("/health").json() == {"status": "ok"}
        assert greedy_text(client) == before
    assert engine.submitted, "no fuzzed request was ever valid: the fuzzer exercised only refusals"


def test_every_wire_field_at_every_edge(tokenizer):
    from fastapi.testclient import TestClient

    engine = FakeEngine()
    with TestClient(create_app(engine, tokenizer, ServerSettings((MODEL_NAME,))), raise_server_exceptions=False) as client:
        for case in edge_grid():
            check_answer(case, send(client, case))
    assert engine.submitted, "no edge value was valid: the grid exercised only refusals"
