"""The GPU's order of a step on the CPU (--pipelined-readback, executor/steps.py): each forward queued
before the sample of the one before is read back, and each step answered from there. A CUDA device
takes it by default; here two ranks run it on the CPU so that what surrounds it is held: every kind
of request gets what the CPU's own order gives it, on the same TP=2 group shape, with frames of
several forwards and steps overlapped (the next one staged while one runs)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.serving import SERVER_OPTIONS, Server
from tests.e2e.test_decode_steps import REQUESTS, completion


@pytest.fixture(scope="module")
def pipelined_tp2(tiny_model: Path) -> Iterator[Server]:
    server = Server(tiny_model, tp=2, extra=(*SERVER_OPTIONS, "--pipelined-readback"))
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("body", REQUESTS, ids=lambda body: ",".join(k for k in body if k != "prompt"))
def test_every_request_gets_what_the_cpus_order_gives(server_tp2: Server, pipelined_tp2: Server, body) -> None:
    assert completion(pipelined_tp2, body) == completion(server_tp2, body)
