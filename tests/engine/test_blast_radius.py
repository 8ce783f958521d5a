"""One sequence whose parameters fail a step on the executors fails only its own request.

The engine runs against two live executors on a tiny real model (fp32, gloo). Requests reach the
engine directly, past the HTTP edge that would refuse them: a top_p of 1e-46 (0 in float32) or a
temperature of 1e-40 passes the scheduler's admission but breaks the executors' checked validation,
so each rank REJECTs the step naming that sequence (REJECT.seq_ids). The bad request joins a step
that also holds the prefill of another request and the decodes of running ones: only the bad one
fails, with an error naming its field, and every other stream finishes token-identical to a run
without the bad one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from executor.options import ExecutorOptions
from protocol.auth import new_key
from protocol.transport import SchedulerEndpoint, ipc_address
from scheduler.request import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scripts.harness.executors import ExecutorCluster
from tests.tiny_models import write_tiny_llama
from tp_runtime.engine import Engine, RequestStream
from tp_runtime.recovery import Fault

RUN_ID = "blast-radius"
WORLD = 2
PAGES, PAGE, SEQS, TOKENS, LENGTH = 64, 16, 8, 128, 256
RUNNING = ((5, 6, 7, 8), (40, 41), (90, 91, 92, 93, 94, 95))  # decoding when the bad request arrives
JOINING = (17, 18, 19)  # admitted in the same step as the bad request
MAX_TOKENS = 24

pytestmark = pytest.mark.timeout(240)


@dataclass
class Live:
    engine: Engine
    cluster: ExecutorCluster

    def rejects(self, above: int = -1, within_s: float = 3.0) -> int:
        """The engine's REJECT count, waited for until it exceeds `above`: the snapshot is published
        after the iteration that delivered the outputs, a moment after the streams saw them."""
        deadline = time.monotonic() + within_s
        while (count := self.engine.stats().rejects_total) <= above and time.monotonic() < deadline:
            time.sleep(0.05)
        return count


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), num_heads=6, num_kv_heads=3)
    options = ExecutorOptions(
        model=str(model), num_kv_pages=PAGES, page_size=PAGE, max_num_seqs=SEQS, max_num_batched_tokens=TOKENS,
        max_model_len=LENGTH, dtype="fp32", kv_cache_dtype="fp32", weight_format="dense", device="cpu",
        cuda_graphs=False, heartbeat_interval_s=0.2,
    )  # fmt: skip
    endpoint = SchedulerEndpoint(ipc_address(), new_key(), RUN_ID)
    scheduler = Scheduler(
        SchedulerConfig(
            num_kv_pages=PAGES, page_size=PAGE, max_num_seqs=SEQS, max_num_batched_tokens=TOKENS, max_model_len=LENGTH,
            enable_prefix_cache=False, max_inflight_steps=2,
        )
    )
    engine = Engine(scheduler=scheduler, endpoint=endpoint, world_size=WORLD, model_name="tiny", max_model_len=LENGTH)
    cluster = ExecutorCluster(
        WORLD, address=endpoint.address, key=endpoint._stamp.key, run_id=RUN_ID, options=options,
        load="executor.model:load_model", log_dir=tmp_path_factory.mktemp("ranks"), log_level="ERROR",
    )  # fmt: skip
    try:
        cluster.start()
        engine.start()
        engine.wait_ready(120)
        yield Live(engine, cluster)
        engine.shutdown("the test is over")
        assert cluster.stop(grace_s=15) == {0: 0, 1: 0}, "a rank did not exit cleanly at SHUTDOWN"
    finally:
        engine.shutdown("the test is over")
        cluster.stop()
        endpoint.close()


@dataclass
class Outcome:
    tokens: list[int]
    finish_reason: str | None
    error: str | None
    fault: str | None


def read(stream: RequestStream, first: list[int] | None = None) -> Outcome:
    tokens = list(first or ())
    for event in stream:
        tokens.extend(event.token_ids)
        if event.finished:
            return Outcome(tokens, event.finish_reason, event.error, event.fault)
    raise AssertionError("the stream ended without a finished event")


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def serve(live: Live, bad: SamplingParams | None) -> tuple[list[Outcome], Outcome | None]:
    """The running requests get their first token, then the joining one (and the bad one, if any)
    arrive together: they are planned into one step with the running ones' decodes."""
    running = [live.engine.submit(list(prompt), greedy()) for prompt in RUNNING]
    firsts = []
    for stream in running:
        event = next(iter(stream))
        assert event.error is None and not event.finished, event
        firsts.append(list(event.token_ids))
    bad_stream = live.engine.submit([60, 61, 62], bad) if bad is not None else None
    joining = live.engine.submit(list(JOINING), greedy())
    outcomes = [read(stream, first) for stream, first in zip(running, firsts)] + [read(joining)]
    return outcomes, (read(bad_stream) if bad_stream is not None else None)


@pytest.mark.parametrize(
    "bad,field",
    [
        (SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, top_p=1e-46), "top_p"),
        (SamplingParams(max_tokens=MAX_TOKENS, temperature=1e-40), "temperature"),
    ],
)
def test_a_request_that_fails_a_step_fails_alone_and_the_others_are_unchanged(
    live: Live, bad: SamplingParams, field: str
) -> None:
    reference, _ = serve(live, None)
    assert all(o.error is None and o.finish_reason == "length" and len(o.tokens) == MAX_TOKENS for o in reference), reference
    rejects = live.rejects()
    outcomes, failed = serve(live, bad)
    assert failed is not None and failed.finish_reason == "error" and failed.tokens == [], failed
    assert field in (failed.error or ""), failed.error
    assert failed.fault == Fault.STEP, "a request its own step failed is counted under the step's label"
    assert live.rejects(above=rejects) > rejects, "no step was refused: the bad request never reached the executors"
    assert [o.tokens for o in outcomes] == [o.tokens for o in reference]
    assert all(o.error is None and o.fault is None and o.finish_reason == "length" for o in outcomes), outcomes
    assert len(live.cluster.survivors()) == WORLD, "a rank exited"
    assert live.engine.health().ok, live.engine.health()
