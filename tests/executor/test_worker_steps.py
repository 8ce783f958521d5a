"""The step loop of one rank, driven in-process through a scripted endpoint (no sockets, no peers)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import executor.sampler
import executor.steps
import executor.worker
from executor.options import ExecutorOptions
from executor.worker import ExitCode, Worker
from tests.executor.executor_standin import KV_HEADS, Seq, StandInModel, geometry, make_cache, make_prepare
from protocol.errors import ProtocolError, RejectCode
from protocol.frames import (
    LAYOUT_VERSION,
    PROTOCOL_VERSION,
    Abort,
    Frame,
    Go,
    Heartbeat,
    Hello,
    Ready,
    Reject,
    Result,
    Shutdown,
    Welcome,
)

RUN = "run-test"
GEOMETRY = geometry()


@pytest.fixture(autouse=True, params=[False, True], ids=["answered-at-once", "pipelined"])
def pipelined(request, monkeypatch) -> bool:
    """Every test in both of the model thread's orders: the CPU's, and a CUDA device's (a step's
    sample taken and the step answered once the next forward is queued, executor/steps.py)."""
    def worker(*, options: ExecutorOptions, **kwargs) -> executor.worker.Worker:
        return executor.worker.Worker(options=replace(options, pipelined_readback=request.param), **kwargs)

    monkeypatch.setitem(globals(), "Worker", worker)
    return request.param


class ScriptedEndpoint:
    """Hands the worker the scripted frames in order (an exception is raised from recv), then silence."""

    def __init__(self, script: list) -> None:
        self.script = deque(script)
        self.sent: list[tuple[int, object]] = []
        self.version = PROTOCOL_VERSION
        self._woken = threading.Event()

    def send(self, body, step: int) -> None:
        self.sent.append((step, body))

    def wake(self) -> None:
        self._woken.set()

    def recv(self, timeout_ms: int):
        if not self.script:
            self._woken.wait(timeout_ms / 1000)
            self._woken.clear()
            return None
        item = self.script.popleft()
        if isinstance(item, Exception):
            raise item
        return item

    def replies(self) -> list[tuple[int, object]]:
        return [(step, body) for step, body in self.sent if not isinstance(body, (Heartbeat, Hello))]


_seq = iter(range(1, 1_000_000))


def frame(step: int, body, *, version: int = PROTOCOL_VERSION, run_id: str = RUN) -> Frame:
    return Frame(version=version, layout=LAYOUT_VERSION, run_id=run_id, step=step, seq=next(_seq), body=body)


def welcome(g=GEOMETRY, *, version=PROTOCOL_VERSION, layout=LAYOUT_VERSION, world_size=1, ready_is_go=False) -> Frame:
    return frame(0, Welcome(version=version, layout=layout, world_size=world_size, geometry=g, ready_is_go=ready_is_go))


def options(**overrides) -> ExecutorOptions:
    base = ExecutorOptions(
        model="stand-in",
        num_kv_pages=GEOMETRY.num_kv_pages,
        page_size=GEOMETRY.page_size,
        max_num_seqs=GEOMETRY.max_num_seqs,
        max_num_batched_tokens=GEOMETRY.max_num_batched_tokens,
        max_model_len=GEOMETRY.max_model_len,
        kv_cache_dtype=GEOMETRY.kv_dtype,
        num_host_pages=GEOMETRY.num_host_pages,
        device="cpu",
        heartbeat_interval_s=0.05,
        peer_timeout_s=2.0,
    )
    return replace(base, **overrides)


def run_worker(script, *, model=None, cache=None, **option_overrides):
    opts = options(**option_overrides)
    endpoint = ScriptedEndpoint(script)
    if cache is None:
        cache = make_cache(GEOMETRY, KV_HEADS, poison=opts.debug_poison_cache)
    worker = Worker(
        rank=0,
        world_size=1,
        endpoint=endpoint,
        cache=cache,
        model=model or StandInModel(0, 1),
        geometry=GEOMETRY,
        options=opts,
        run_id=RUN,
    )
    return worker.run(), endpoint, cache


def test_hello_carries_this_rank_and_a_clean_step_returns_a_result():
    prepare = make_prepare([Seq(7, (3, 4, 5), 0, (2,)), Seq(9, (10,), 0, (4,))], cleared=(2, 4))
    code, endpoint, _ = run_worker(
        [welcome(), frame(1, prepare), frame(1, Go()), frame(1, Shutdown("done"))]
    )
    assert code == ExitCode.OK
    hello = endpoint.sent[0][1]
    assert isinstance(hello, Hello)
    assert (hello.rank, hello.world_size, hello.geometry) == (0, 1, GEOMETRY)
    assert hello.model_fingerprint == "stand-in-v1"
    (s1, ready), (s2, result) = endpoint.replies()
    assert (s1, s2) == (1, 1) and isinstance(ready, Ready)
    assert isinstance(result, Result)
    assert result.seq_ids.tolist() == [7, 9]
    assert result.token_ids.tolist() == [6, 11]  # last token + 1 (one rank)
    assert result.finite.tolist() == [1, 1]
    assert np.all(np.isfinite(result.logprobs))
    assert result.step_time_us > 0


def test_a_lone_rank_told_ready_is_go_runs_each_step_on_its_ready_without_a_go():
    first = make_prepare([Seq(7, (3, 4, 5), 0, (2,)), Seq(9, (10,), 0, (4,))], cleared=(2, 4))
    code, endpoint, _ = run_worker([welcome(ready_is_go=True), frame(1, first), frame(1, Shutdown("done"))])
    assert code == ExitCode.OK
    (s1, ready), (s2, result) = endpoint.replies()
    assert (s1, s2) == (1, 1) and isinstance(ready, Ready) and isinstance(result, Result)
    assert result.token_ids.tolist() == [6, 11]  # as the GOed step above


@pytest.mark.parametrize(
    "bad_welcome, words",
    [
        (welcome(replace(GEOMETRY, num_kv_pages=32)), "num_kv_pages 32"),
        (welcome(replace(GEOMETRY, kv_dtype="bf16")), "kv_dtype"),
        (welcome(version=99), "protocol version 99"),
        (welcome(layout=7), "cache layout 7"),
        (welcome(world_size=2), "world size 2"),
        (frame(0, Shutdown("rank 1 has model fingerprint other, rank 0 has stand-in-v1")), "fingerprint other"),
    ],
)
def test_handshake_mismatch_is_refused_with_a_clear_error(bad_welcome, words, caplog):
    with caplog.at_level(logging.ERROR, logger="tp_runtime.executor"):
        code, endpoint, _ = run_worker([bad_welcome, frame(1, Shutdown("unreached"))])
    assert code == ExitCode.HANDSHAKE_REFUSED
    assert endpoint.replies() == []
    refused = [r.getMessage() for r in caplog.records if "handshake refused" in r.getMessage()]
    assert refused and words in refused[0] and refused[0].startswith("[rank 0]")


def test_rejects_keep_the_executor_up_and_the_next_valid_step_runs():
    good = make_prepare([Seq(1, (20,), 0, (0,))], cleared=(0,))
    out_of_range = make_prepare([Seq(1, (20,), 0, (GEOMETRY.num_kv_pages,))])
    script = [
        welcome(),
        frame(1, out_of_range),
        frame(1, Abort("rank 0 rejected")),
        frame(2, good, version=PROTOCOL_VERSION + 1),
        frame(2, Abort("rank 0 rejected")),
        ProtocolError(RejectCode.BAD_MAC, "MAC does not match"),
        frame(3, Abort("rank 0 rejected")),
        frame(5, good),  # skips step 4
        frame(5, Abort("out of sequence")),
        frame(6, Go()),  # nothing staged
        frame(6, good),
        frame(6, Go()),
        frame(6, Shutdown("done")),
    ]
    code, endpoint, _ = run_worker(script)
    assert code == ExitCode.OK
    replies = endpoint.replies()
    rejects = [(step, RejectCode(body.code)) for step, body in replies if isinstance(body, Reject)]
    assert rejects == [
        (1, RejectCode.PAGE_OUT_OF_RANGE),
        (2, RejectCode.BAD_VERSION),
        (3, RejectCode.BAD_MAC),
        (5, RejectCode.BAD_STEP),
        (6, RejectCode.UNEXPECTED_FRAME),
    ]
    assert [(s, type(b)) for s, b in replies[-2:]] == [(6, Ready), (6, Result)]
    assert replies[-1][1].token_ids.tolist() == [21]


def test_ready_goes_out_before_the_steps_inputs_are_built(monkeypatch):
    """Only the checks may refuse a step: its READY goes as soon as they pass, and the step's inputs
    are built after it, before its GO is read."""
    import executor.link as link

    order: list[tuple[str, int]] = []
    build = link.StepInputs.from_prepare

    def recorded(prepare, **kwargs):
        order.append(("built", len([r for r in order if r[0] == "built"]) + 1))
        return build(prepare, **kwargs)

    monkeypatch.setattr(link.StepInputs, "from_prepare", recorded)
    send = ScriptedEndpoint.send
    monkeypatch.setattr(ScriptedEndpoint, "send", lambda self, body, step: (order.append((type(body).__name__, step)), send(self, body, step)))
    steps = [make_prepare([Seq(1, (20,), 0, (0,))], cleared=(0,)), make_prepare([Seq(1, (0,), 1, (0,), held=1, feedback=True)])]
    script = [welcome(), frame(1, steps[0]), frame(1, Go()), frame(2, steps[1]), frame(2, Go()), frame(2, Shutdown("done"))]
    code, endpoint, _ = run_worker(script)
    assert code == ExitCode.OK
    seen = [event for event in order if event[0] in ("Ready", "built")]
    assert seen == [("Ready", 1), ("built", 1), ("Ready", 2), ("built", 2)]
    assert [b.token_ids.tolist() for _, b in endpoint.replies() if isinstance(b, Result)] == [[21], [22]]


def test_abort_drops_the_staged_step():
    model = StandInModel(0, 1)
    prepare = make_prepare([Seq(1, (20,), 0, (0,))], cleared=(0,))
    script = [welcome(), frame(1, prepare), frame(1, Abort("peer rejected")), frame(1, Go()), frame(1, Shutdown("x"))]
    code, endpoint, _ = run_worker(script, model=model)
    assert code == ExitCode.OK
    assert model.forward_calls == 0
    kinds = [type(b) for _, b in endpoint.replies()]
    assert kinds == [Ready, Reject]


def test_page_table_deltas_build_on_the_tables_held_from_the_last_step():
    # Every page starts poisoned: a table rebuilt wrong would read an uncleared page, and NaN.
    step1 = make_prepare([Seq(1, (20, 21, 22, 23), 0, (5,)), Seq(2, (30,), 0, (6,))], cleared=(5, 6))
    step2 = make_prepare([Seq(1, (24,), 4, (5, 9), held=1), Seq(2, (31,), 1, (6,), held=1)], cleared=(9,))
    script = [welcome(), frame(1, step1), frame(1, Go()), frame(2, step2), frame(2, Go()), frame(2, Shutdown("x"))]
    code, endpoint, _ = run_worker(script, debug_poison_cache=True)
    assert code == ExitCode.OK
    results = [body for _, body in endpoint.replies() if isinstance(body, Result)]
    assert [r.finite.tolist() for r in results] == [[1, 1], [1, 1]]
    assert results[1].token_ids.tolist() == [25, 32]


def test_a_base_the_executor_does_not_hold_is_rejected_and_an_abort_drops_every_table():
    full = make_prepare([Seq(1, (20,), 0, (0,))], cleared=(0,))
    grown = make_prepare([Seq(1, (21,), 1, (0,), held=1)])
    too_long = make_prepare([Seq(1, (21,), 1, (0, 1), held=2)])
    other = make_prepare([Seq(2, (21,), 1, (0,), held=1)])
    script = [
        welcome(),
        frame(1, full), frame(1, Go()),
        frame(2, too_long),  # holds 1 page of sequence 1, not 2
        frame(2, Abort("rank 0 rejected")),
        frame(3, grown),  # the abort dropped every table
        frame(3, Abort("rank 0 rejected")),
        frame(4, full), frame(4, Go()),
        frame(5, other),  # sequence 2 was never sent whole
        frame(5, Abort("rank 0 rejected")),
        frame(6, full), frame(6, Go()),
        frame(7, grown), frame(7, Go()),
        frame(7, Shutdown("x")),
    ]
    code, endpoint, _ = run_worker(script)
    assert code == ExitCode.OK
    replies = endpoint.replies()
    rejects = [(step, RejectCode(body.code)) for step, body in replies if isinstance(body, Reject)]
    assert rejects == [(s, RejectCode.PAGE_TABLE_BASE_MISMATCH) for s in (2, 3, 5)]
    assert "sequence 1" in next(b.message for _, b in replies if isinstance(b, Reject))
    assert [s for s, b in replies if isinstance(b, Result)] == [1, 4, 6, 7]


@pytest.mark.parametrize("skip_clears", [False, True])
def test_poisoned_cache_is_read_safely_only_when_listed_pages_are_cleared(skip_clears):
    # Three tokens on a fresh page: slot 3 is past the context, so only the clear keeps it finite.
    prepare = make_prepare([Seq(1, (20, 21, 22), 0, (5,))], cleared=(5,))
    script = [welcome(), frame(1, prepare), frame(1, Go()), frame(1, Shutdown("x"))]
    code, endpoint, _ = run_worker(script, debug_poison_cache=True, debug_skip_clears=skip_clears)
    assert code == ExitCode.OK
    result = endpoint.replies()[-1][1]
    if skip_clears:
        assert result.finite.tolist() == [0] and result.token_ids.tolist() == [0]
        assert np.isnan(result.logprobs[0])
    else:
        assert result.finite.tolist() == [1] and result.token_ids.tolist() == [23]


def zeroed_cache():
    cache = make_cache(GEOMETRY, KV_HEADS, poison=False)
    cache.data.zero_()
    return cache


def test_step_order_offload_poison_restore_clear():
    cache = zeroed_cache()
    g = torch.Generator().manual_seed(0)
    page3 = torch.randn(cache.data[3].shape, generator=g)
    saved = torch.randn(cache.data[3].shape, generator=g)
    cache.data[3] = page3
    cache.host[0] = saved
    prepare = make_prepare(
        [Seq(1, (20,), 0, (9,))],
        cleared=(3, 9),
        offload=((3, 1),),
        restore=((5, 0),),
        poison=(5, 6),
    )
    code, _, _ = run_worker(
        [welcome(), frame(1, prepare), frame(1, Go()), frame(1, Shutdown("x"))], cache=cache, debug_poison_freed=True
    )
    assert code == ExitCode.OK
    assert torch.equal(cache.host[1], page3), "offload reads the page before the clear zeroes it"
    assert bool((cache.data[3].view(torch.uint8) == 0).all())
    assert torch.equal(cache.data[5], saved), "restore lands after the poison of its target"
    assert bool(torch.isnan(cache.data[6]).all()), "a freed page is poisoned when debug_poison_freed"


@pytest.mark.parametrize("poison_freed", [False, True])
def test_poison_pages_are_honoured_only_with_the_debug_flag(poison_freed):
    cache = zeroed_cache()
    prepare = make_prepare([Seq(1, (20,), 0, (9,))], cleared=(9,), poison=(6,))
    code, _, _ = run_worker(
        [welcome(), frame(1, prepare), frame(1, Go()), frame(1, Shutdown("x"))], cache=cache, debug_poison_freed=poison_freed
    )
    assert code == ExitCode.OK
    page6 = cache.data[6].view(torch.uint8)
    assert bool((page6 == 0xFF).all()) if poison_freed else bool((page6 == 0).all())


def test_silent_scheduler_ends_the_executor(caplog):
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="tp_runtime.executor"):
        code, endpoint, _ = run_worker([welcome()], peer_timeout_s=0.4, heartbeat_interval_s=0.1)
    elapsed = time.monotonic() - started
    assert code == ExitCode.SCHEDULER_SILENT
    assert 0.4 <= elapsed < 2.0
    beats = [b for _, b in endpoint.sent if isinstance(b, Heartbeat)]
    assert len(beats) >= 3 and all(b.rank == 0 for b in beats)
    assert any("nothing from the scheduler" in r.getMessage() for r in caplog.records)


def test_heartbeats_from_the_scheduler_keep_the_executor_alive():
    script = [welcome()] + [frame(0, Heartbeat(-1)) for _ in range(3)] + [frame(0, Shutdown("x"))]
    code, _, _ = run_worker(script, peer_timeout_s=0.3, heartbeat_interval_s=0.1)
    assert code == ExitCode.OK


def test_a_forward_longer_than_the_peer_timeout_is_not_scheduler_silence():
    class Slow(StandInModel):
        def forward(self, inputs, cache):
            time.sleep(0.5)
            return super().forward(inputs, cache)

    prepare = make_prepare([Seq(1, (20,), 0, (0,))], cleared=(0,))
    script = [welcome(), frame(1, prepare), frame(1, Go()), frame(1, Shutdown("x"))]
    code, endpoint, _ = run_worker(script, model=Slow(0, 1), peer_timeout_s=0.3, heartbeat_interval_s=0.1)
    assert code == ExitCode.OK
    assert isinstance(endpoint.replies()[-1][1], Result)


def test_a_failing_forward_ends_the_executor_with_a_reject():
    class Broken(StandInModel):
        def forward(self, inputs, cache):
            raise RuntimeError("gloo: connection reset by peer")

    prepare = make_prepare([Seq(1, (20,), 0, (0,))], cleared=(0,))
    code, endpoint, _ = run_worker([welcome(), frame(1, prepare), frame(1, Go())], model=Broken(0, 1))
    assert code == ExitCode.STEP_FAILED
    step, reject = endpoint.replies()[-1]
    assert step == 1 and reject.code == RejectCode.INTERNAL and "connection reset" in reject.message


def test_a_result_that_cannot_be_made_fails_its_step(monkeypatch):
    # The link's thread makes the RESULT as it sends it (off the model's thread): a failure there
    # is the step's, named by a REJECT, as a failed forward's is, and the rank ends.
    def broken(opened, ended):
        raise ValueError("a sample of the wrong length")

    monkeypatch.setattr(executor.steps, "_result", broken)
    assert "could not make step 1's RESULT: a sample of the wrong length" in lone_step_refused()


def lone_step_refused() -> str:
    """Runs one step whose answer must be a REJECT(INTERNAL) with the rank ending STEP_FAILED; the
    REJECT's message."""
    prepare = make_prepare([Seq(1, (20,), 0, (0,))], cleared=(0,))
    code, endpoint, _ = run_worker([welcome(), frame(1, prepare), frame(1, Go())])
    assert code == ExitCode.STEP_FAILED
    [(step, reject)] = [(s, b) for s, b in endpoint.replies() if isinstance(b, (Result, Reject))]
    assert step == 1 and isinstance(reject, Reject) and reject.code == RejectCode.INTERNAL
    return reject.message


class GatedModel(StandInModel):
    """A stand-in whose forwards wait until the test lets them go, so that frames can arrive while
    a step runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def forward(self, inputs, cache):
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return super().forward(inputs, cache)


class FeedingEndpoint(ScriptedEndpoint):
    """A scripted endpoint whose script is fed by the test while the worker runs."""

    def __init__(self) -> None:
        super().__init__([])
        self.lock = threading.Lock()

    def push(self, *items) -> None:
        with self.lock:
            self.script.extend(items)
        self.wake()

    def recv(self, timeout_ms: int):
        with self.lock:
            item = self.script.popleft() if self.script else None
        if item is None:
            self._woken.wait(timeout_ms / 1000)
            self._woken.clear()
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def wait_for(self, predicate, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [x for x in self.replies() if predicate(x)]
            if found:
                return found[0]
            time.sleep(0.005)
        raise AssertionError(f"nothing matched among {self.replies()}")


def start_worker(model, before_start=None, **option_overrides):
    """The worker on a thread of its own; before_start(worker) may wrap its parts first."""
    endpoint = FeedingEndpoint()
    cache = make_cache(GEOMETRY, KV_HEADS, poison=True)
    worker = Worker(
        rank=0, world_size=1, endpoint=endpoint, cache=cache, model=model, geometry=GEOMETRY,
        options=options(**option_overrides), run_id=RUN,
    )
    if before_start is not None:
        before_start(worker)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(worker.run()))
    thread.start()
    return endpoint, thread, codes


def test_the_next_step_is_staged_and_ready_while_this_one_runs_and_feedback_takes_its_sample():
    model = GatedModel(0, 1)
    endpoint, thread, codes = start_worker(model)
    step1 = make_prepare([Seq(1, (20,), 0, (0,)), Seq(2, (30, 31), 0, (1,))], cleared=(0, 1))
    step2 = make_prepare([Seq(1, (0,), 1, (0,), held=1, feedback=True), Seq(2, (0,), 2, (1,), held=1, feedback=True)])
    endpoint.push(welcome(), frame(1, step1), frame(1, Go()))
    assert model.entered.wait(10)
    endpoint.push(frame(2, step2), frame(2, Go()))
    ready2 = endpoint.wait_for(lambda r: r[0] == 2 and isinstance(r[1], Ready))
    assert not [r for r in endpoint.replies() if isinstance(r[1], Result)], "READY 2 came before step 1 ended"
    model.gate.set()
    endpoint.wait_for(lambda r: r[0] == 2 and isinstance(r[1], Result))
    endpoint.push(frame(2, Shutdown("done")))
    thread.join(10)
    assert codes == [ExitCode.OK] and ready2
    results = [(s, b.token_ids.tolist()) for s, b in endpoint.replies() if isinstance(b, Result)]
    # One rank: each sample is its input token + 1, and step 2's inputs are step 1's samples.
    assert results == [(1, [21, 32]), (2, [22, 33])]


def test_feedback_for_a_sequence_the_last_step_did_not_sample_is_refused_by_its_id():
    model = StandInModel(0, 1)
    step1 = make_prepare([Seq(1, (20,), 0, (0,)), Seq(2, (30,), 0, (1,))], cleared=(0, 1))
    step2 = make_prepare([Seq(1, (0,), 1, (0,), held=1, feedback=True), Seq(3, (0,), 0, (2,), feedback=True)])
    code, endpoint, _ = run_worker(
        [welcome(), frame(1, step1), frame(1, Go()), frame(2, step2), frame(2, Abort("x")), frame(2, Shutdown("x"))],
        model=model,
    )
    assert code == ExitCode.OK
    (step, reject), = [(s, b) for s, b in endpoint.replies() if isinstance(b, Reject)]
    assert step == 2 and reject.code == RejectCode.FEEDBACK_WITHOUT_SAMPLE
    assert reject.seq_ids.tolist() == [3]


def test_a_sequence_with_bad_sampling_parameters_is_named_in_the_reject():
    good = make_prepare([Seq(1, (20,), 0, (0,)), Seq(2, (30,), 0, (1,))], cleared=(0, 1))
    bad = replace(good, top_p=np.array([1.0, 0.0], dtype=np.float32))
    code, endpoint, _ = run_worker([welcome(), frame(1, bad), frame(1, Abort("x")), frame(1, Shutdown("x"))])
    assert code == ExitCode.OK
    (reject,) = [b for _, b in endpoint.replies() if isinstance(b, Reject)]
    assert reject.code == RejectCode.BAD_SAMPLING and reject.seq_ids.tolist() == [2]


def test_heartbeats_go_on_while_a_forward_runs():
    model = GatedModel(0, 1)
    endpoint, thread, codes = start_worker(model, heartbeat_interval_s=0.05)
    endpoint.push(welcome(), frame(1, make_prepare([Seq(1, (20,), 0, (0,))], cleared=(0,))), frame(1, Go()))
    assert model.entered.wait(10)
    before = sum(isinstance(b, Heartbeat) for _, b in endpoint.sent)
    time.sleep(0.5)
    during = sum(isinstance(b, Heartbeat) for _, b in endpoint.sent) - before
    model.gate.set()
    endpoint.push(frame(1, Shutdown("x")))
    thread.join(10)
    assert codes == [ExitCode.OK]
    assert during >= 5, f"{during} heartbeats in 0.5 s of forward at a 0.05 s interval"


class TimedEndpoint(FeedingEndpoint):
    """A feeding endpoint that notes when each frame went out."""

    def __init__(self) -> None:
        super().__init__()
        self.sent_at: list[float] = []

    def send(self, body, step: int) -> None:
        super().send(body, step)
        self.sent_at.append(time.monotonic())


def test_a_heartbeat_goes_out_only_after_an_interval_without_any_frame():
    # Steps of 20 ms, one after the other for about a second: their READYs and RESULTs tell the
    # scheduler the rank lives, and a heartbeat goes only where nothing else went for an interval.
    class Stepping(StandInModel):
        def forward(self, inputs, cache):
            time.sleep(0.02)
            return super().forward(inputs, cache)

    interval = 0.1
    endpoint = TimedEndpoint()
    worker = Worker(
        rank=0, world_size=1, endpoint=endpoint, cache=make_cache(GEOMETRY, KV_HEADS, poison=True), model=Stepping(0, 1),
        geometry=GEOMETRY, options=options(heartbeat_interval_s=interval), run_id=RUN,
    )  # fmt: skip
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(worker.run()))
    thread.start()
    try:
        endpoint.push(welcome())
        for step in range(1, 51):
            page = step % GEOMETRY.num_kv_pages
            endpoint.push(frame(step, make_prepare([Seq(step, (20,), 0, (page,))], cleared=(page,))), frame(step, Go()))
            endpoint.wait_for(lambda r, step=step: r[0] == step and isinstance(r[1], Result))
        last_result = len(endpoint.sent)
        # The silence after the last step is filled by heartbeats again.
        deadline = time.monotonic() + 10
        while not any(isinstance(b, Heartbeat) for _, b in endpoint.sent[last_result:]) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        endpoint.push(frame(0, Shutdown("done")))
        thread.join(10)
    assert codes == [ExitCode.OK]
    assert any(isinstance(b, Heartbeat) for _, b in endpoint.sent[last_result:])
    for i, (_, body) in enumerate(endpoint.sent):
        if isinstance(body, Heartbeat) and i:
            assert endpoint.sent_at[i] - endpoint.sent_at[i - 1] >= interval, f"heartbeat {i} came {endpoint.sent_at[i] - endpoint.sent_at[i - 1]:.3f} s after a frame"


def test_a_step_stuck_after_shutdown_ends_the_process():
    model = GatedModel(0, 1)
    exits: list[int] = []
    endpoint = FeedingEndpoint()
    worker = Worker(
        rank=0, world_size=1, endpoint=endpoint, cache=make_cache(GEOMETRY, KV_HEADS, poison=True), model=model,
        geometry=GEOMETRY, options=options(stuck_grace_s=0.3), run_id=RUN, force_exit=exits.append,
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    endpoint.push(welcome(), frame(1, make_prepare([Seq(1, (20,), 0, (0,))], cleared=(0,))), frame(1, Go()))
    assert model.entered.wait(10)
    started = time.monotonic()
    endpoint.push(frame(1, Shutdown("rank 1 stopped answering")))
    while not exits and time.monotonic() - started < 5:
        time.sleep(0.01)
    assert exits == [ExitCode.STEP_FAILED]
    assert 0.3 <= time.monotonic() - started < 2.0
    model.gate.set()
    thread.join(10)


class FixedLogits(StandInModel):
    """Every sampled row: token 10 at 3.0, token 11 at 2.0, the rest 0, whatever the input, so that
    a presence penalty of 2 on the tokens a sequence generated decides between them."""

    def forward(self, inputs, cache):
        super().forward(inputs, cache)
        logits = torch.zeros(inputs.sample_rows.shape[0], GEOMETRY.vocab_size)
        logits[:, 10], logits[:, 11] = 3.0, 2.0
        return logits


def with_presence(prepare, state: int, output: tuple[int, ...] = ()):
    """Sequence 0 of `prepare` with a presence penalty of 2 and its sampling state: sent whole with
    `output` (state 1) or held (state 2)."""
    n = len(prepare.seq_ids)
    presence = np.zeros(n, dtype=np.float32)
    presence[0] = 2.0
    states = np.zeros(n, dtype=np.uint8)
    states[0] = state
    lens = np.zeros(n, dtype=np.int32)
    lens[0] = len(output) if state == 1 else 0
    return replace(
        prepare, presence_penalty=presence, sampling_state=states, history_lens=lens,
        history=np.asarray(output if state == 1 else (), dtype=np.int32),
    )


def test_the_sampling_state_is_held_across_steps_and_rebuilt_after_an_abort_and_an_absence(pipelined, monkeypatch):
    if pipelined:  # on a device still running each step when the next comes: its tokens are taken late
        read_back_behind(monkeypatch, lambda: False, lambda: None)
    step = lambda start, held: make_prepare([Seq(1, (20,), start, (0,), held=held)], cleared=() if held else (0,))  # noqa: E731
    other = make_prepare([Seq(2, (30,), 0, (1,))], cleared=(1,))
    script = [
        welcome(),
        frame(1, with_presence(step(0, 0), 1)), frame(1, Go()),  # sent whole, no output yet: 10
        frame(2, with_presence(step(1, 1), 2)), frame(2, Go()),  # held: 10 is penalized now: 11
        frame(3, with_presence(step(2, 1), 2)), frame(3, Go()),  # held [10, 11]: 10
        frame(4, with_presence(step(3, 1), 2)), frame(4, Abort("rank 1 rejected")),
        frame(5, with_presence(step(3, 0), 2)),  # the abort dropped every state (the table travels whole)
        frame(5, Abort("rank 0 rejected")),
        frame(6, with_presence(step(3, 0), 1, (10,))), frame(6, Go()),  # rebuilt from the wire: 11
        frame(7, other), frame(7, Go()),  # sequence 1 absent: forgotten (a preemption)
        frame(8, with_presence(step(0, 0), 2)),
        frame(8, Abort("rank 0 rejected")),
        frame(9, with_presence(step(0, 0), 1, (11,))), frame(9, Go()),  # recomputed, its output sent: 10
        frame(9, Shutdown("done")),
    ]
    code, endpoint, _ = run_worker(script, model=FixedLogits(0, 1))
    assert code == ExitCode.OK
    replies = endpoint.replies()
    rejects = [(s, RejectCode(b.code)) for s, b in replies if isinstance(b, Reject)]
    assert rejects == [(5, RejectCode.SAMPLING_STATE_NOT_HELD), (8, RejectCode.SAMPLING_STATE_NOT_HELD)]
    results = {s: b.token_ids.tolist() for s, b in replies if isinstance(b, Result)}
    assert results == {1: [10], 2: [11], 3: [10], 6: [11], 7: [10], 9: [10]}


def test_banned_tokens_and_min_p_reach_the_sample_without_any_sampling_state():
    """Neither needs a sampling state, and the link decides whether a step has work for the
    states where it stages it (touches_states): a step with only these still gets its processing."""
    seqs = [Seq(i, (20,), 0, (i,), temperature=1.0) for i in range(8)]
    min_p = replace(make_prepare(seqs, cleared=tuple(range(8))), min_p=np.full(8, 0.99, dtype=np.float32))
    # 10 alone is within 0.99 of the most likely (itself): without min_p each row draws it ~1 time in 5.
    banned = replace(
        make_prepare([Seq(9, (20,), 0, (8,))], cleared=(8,)),
        banned_lens=np.array([1], dtype=np.int32), banned_ids=np.array([10], dtype=np.int32),
    )
    script = [welcome(), frame(1, min_p), frame(1, Go()), frame(2, banned), frame(2, Go()), frame(2, Shutdown("x"))]
    code, endpoint, _ = run_worker(script, model=FixedLogits(0, 1))
    assert code == ExitCode.OK
    results = {s: b.token_ids.tolist() for s, b in endpoint.replies() if isinstance(b, Result)}
    assert results == {1: [10] * 8, 2: [11]}  # greedy with 10 banned: 11


def test_each_forward_of_a_frame_counts_the_tokens_of_the_forwards_before_it(pipelined, monkeypatch):
    if pipelined:
        read_back_behind(monkeypatch, lambda: False, lambda: None)
    # Forward k's penalties count forward k-1's token: pipelined, that sample is taken to the host
    # once forward k is queued, and before forward k's own sample is drawn.
    frame_of_3 = replace(with_presence(make_prepare([Seq(1, (20,), 0, (0,))], cleared=(0,)), 1), decode_steps=3)
    code, endpoint, _ = run_worker([welcome(), frame(1, frame_of_3), frame(1, Go()), frame(1, Shutdown("x"))], model=FixedLogits(0, 1))
    assert code == ExitCode.OK
    (result,) = [b for _, b in endpoint.replies() if isinstance(b, Result)]
    assert result.token_ids.tolist() == [10, 11, 10]


def test_alternatives_come_back_with_the_sample():
    prepare = make_prepare([Seq(1, (20,), 0, (0,)), Seq(2, (30,), 0, (1,))], cleared=(0, 1))
    prepare = replace(prepare, num_logprobs=np.array([3, 0], dtype=np.uint8))
    code, endpoint, _ = run_worker([welcome(), frame(1, prepare), frame(1, Go()), frame(1, Shutdown("x"))], model=FixedLogits(0, 1))
    assert code == ExitCode.OK
    (result,) = [b for _, b in endpoint.replies() if isinstance(b, Result)]
    assert result.top_token_ids.tolist()[:2] == [10, 11] and len(result.top_token_ids) == 3
    row = torch.zeros(GEOMETRY.vocab_size)
    row[10], row[11] = 3.0, 2.0
    expected = torch.log_softmax(row, dim=-1)
    np.testing.assert_allclose(result.top_logprobs[:2], [expected[10].item(), expected[11].item()], rtol=1e-6)
    assert result.logprobs[0] == result.top_logprobs[0]


def run_step_then_its_follower(endpoint, model, handed_over: threading.Event | None = None) -> None:
    """Step 1 (clears page 0) runs behind the model's gate while step 2 (its sequence's feedback,
    clears page 5) is staged and GOed; then the gate opens (once `handed_over` is set, if given)."""
    step1 = make_prepare([Seq(1, (20,), 0, (0,))], cleared=(0,))
    step2 = make_prepare([Seq(1, (0,), 1, (0, 5), held=1, feedback=True)], cleared=(5,))
    endpoint.push(welcome(), frame(1, step1), frame(1, Go()))
    assert model.entered.wait(10)
    endpoint.push(frame(2, step2), frame(2, Go()))
    endpoint.wait_for(lambda r: r[0] == 2 and isinstance(r[1], Ready))
    if handed_over is not None:
        assert handed_over.wait(10)
    model.gate.set()


def failed_follower(model, before_start=None) -> tuple[list[tuple[int, type]], str]:
    """run_step_then_its_follower on a worker that fails there: the steps' answers (RESULT or
    REJECT, in order) and the last one's message, once the worker exited STEP_FAILED."""
    endpoint, thread, codes = start_worker(model, before_start=before_start)
    run_step_then_its_follower(endpoint, model)
    thread.join(10)
    assert codes == [ExitCode.STEP_FAILED]
    answers = [(s, b) for s, b in endpoint.replies() if isinstance(b, (Result, Reject))]
    return [(s, type(b)) for s, b in answers], answers[-1][1].message


def test_a_steps_answer_goes_out_as_the_next_steps_forward_starts_and_at_once_when_none_is_here(pipelined, monkeypatch):
    # Sent at once, RESULT 1 brought the scheduler's next PREPARE while step 2 got its feed and
    # cleared its pages, and the link thread staged it there, taking the GIL from the model's thread
    # between two forwards. So it waits for step 2's forward when step 2 is here already; with
    # nothing queued (serial, or the last step) it goes at once. Pipelined, on a device still running
    # step 1's forward, step 1's sample is taken to the host only once step 2's forward is queued
    # (which decodes it from the device), and step 1 is answered from there.
    model = GatedModel(0, 1)
    order: list[tuple] = []
    cleared_ahead = threading.Event()

    def record(worker):
        cache = worker.runner.cache
        finish, clear, clear_beside, forward = worker.link.finish, cache.clear_pages, cache.clear_pages_beside, model.forward

        def finishing(step, result, still_busy=False):
            order.append(("answer", step, still_busy))  # the link keeps counting the running step busy
            finish(step, result, still_busy)

        def clearing(pages):
            order.append(("clear", int(pages[0])))
            clear(pages)

        def clearing_ahead(pages):
            order.append(("clear ahead", int(pages[0])))
            clear_beside(pages)
            cleared_ahead.set()

        def forwarding(inputs, cache):
            order.append(("forward", int(inputs.token_ids[0])))
            return forward(inputs, cache)

        worker.link.finish, model.forward = finishing, forwarding
        cache.clear_pages, cache.clear_pages_beside = clearing, clearing_ahead

    if pipelined:  # each sample lands once the forward after it is queued
        read_back_behind(monkeypatch, lambda: ("forward", 21) in order or ("answer", 1, True) in order, lambda: None)
    endpoint, thread, codes = start_worker(model, before_start=record)
    run_step_then_its_follower(endpoint, model, handed_over=cleared_ahead)
    # Nothing comes after step 2: its RESULT goes out without another frame to end the wait.
    endpoint.wait_for(lambda r: r[0] == 2 and isinstance(r[1], Result))
    endpoint.push(frame(2, Shutdown("done")))
    thread.join(10)
    assert codes == [ExitCode.OK]
    # Step 2 decodes step 1's sample (20 + 1): its feed landed before its forward. Its page was
    # cleared as it was staged, while step 1's forward ran (executor/clear_ahead.py); step 1's, the
    # first, by the model's thread.
    step_2 = [("forward", 21), ("answer", 1, True)] if pipelined else [("answer", 1, True), ("forward", 21)]
    assert order == [("clear", 0), ("forward", 20), ("clear ahead", 5), *step_2, ("answer", 2, False)]
    assert [s for s, b in endpoint.replies() if isinstance(b, Result)] == [1, 2]


def test_pipelined_a_step_that_comes_while_the_device_works_is_queued_before_the_step_before_is_answered(
    pipelined, monkeypatch
):
    # run() returns once the step is queued; the scheduler's next step comes a little later, while
    # the device still runs this one. Answering first would wait for the device and leave it idle
    # until the next step came; the worker waits for either instead.
    if not pipelined:
        pytest.skip("the CPU's order answers a step as it ends")
    landed, waiting = threading.Event(), threading.Event()

    def on_device(readback):
        waiting.set()  # the worker asks, with step 1 run: it waits for a command or the landing
        return landed.is_set()

    monkeypatch.setattr(executor.steps._Readback, "landed", on_device)
    order: list[tuple] = []

    def record(worker):
        finish, forward = worker.link.finish, worker.runner.model.forward

        def finishing(step, result, still_busy=False):
            order.append(("answer", step, still_busy))
            finish(step, result, still_busy)

        def forwarding(inputs, cache):
            order.append(("forward", int(inputs.token_ids[0])))
            return forward(inputs, cache)

        worker.link.finish, worker.runner.model.forward = finishing, forwarding

    endpoint, thread, codes = start_worker(StandInModel(0, 1), before_start=record)
    endpoint.push(welcome(), frame(1, make_prepare([Seq(1, (20,), 0, (0,))], cleared=(0,))), frame(1, Go()))
    assert waiting.wait(10)
    endpoint.push(frame(2, make_prepare([Seq(1, (0,), 1, (0, 5), held=1, feedback=True)], cleared=(5,))), frame(2, Go()))
    endpoint.wait_for(lambda r: r[0] == 1 and isinstance(r[1], Result))
    landed.set()  # step 2's sample lands with nothing after it: answered at once
    endpoint.wait_for(lambda r: r[0] == 2 and isinstance(r[1], Result))
    endpoint.push(frame(2, Shutdown("done")))
    thread.join(10)
    assert codes == [ExitCode.OK]
    assert order == [("forward", 20), ("forward", 21), ("answer", 1, True), ("answer", 2, False)]


def test_a_step_that_fails_before_its_forward_still_sends_the_answer_of_the_step_before():
    model = GatedModel(0, 1)

    def failing_clear(worker):
        # Ahead, on the link thread, first (step 2 is staged while step 1 runs): that failure leaves
        # the clear to the model's thread, whose failure fails the step.
        cache = worker.runner.cache
        clear, clear_beside = cache.clear_pages, cache.clear_pages_beside

        def failing(clear):
            def clearing(pages):
                if int(pages[0]) == 5:
                    raise RuntimeError("a device error while clearing")
                clear(pages)

            return clearing

        cache.clear_pages, cache.clear_pages_beside = failing(clear), failing(clear_beside)

    answers, message = failed_follower(model, before_start=failing_clear)
    assert answers == [(1, Result), (2, Reject)]
    assert "device error while clearing" in message


def test_a_forward_that_fails_answers_the_step_before_it_first():
    # Pipelined, step 1 is still open when step 2's forward fails: it is answered before the
    # REJECT, as the CPU's order sends its held answer.
    class FailsOnStep2(GatedModel):
        def forward(self, inputs, cache):
            if int(inputs.token_ids[0]) == 21:  # step 2 decodes step 1's sample, 20 + 1
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return super().forward(inputs, cache)

    answers, message = failed_follower(FailsOnStep2(0, 1))
    assert answers == [(1, Result), (2, Reject)]
    assert "illegal memory access" in message


class FakeCopyEvent:
    """A CUDA event after a sample's copy to the host, stood in on the CPU: `query` and
    `synchronize` as the test makes them."""

    def __init__(self, query, synchronize) -> None:
        self.query, self.synchronize = query, synchronize


def read_back_behind(monkeypatch, query, synchronize) -> None:
    """Every sample read back behind a FakeCopyEvent, as on a device (the copy itself is the packed
    sample, which unpack_sampled reads as it reads the pinned one)."""

    def start(inputs, out, made=None):  # a device's copy: where the host pass would write is not read
        return executor.steps._Readback(inputs, out, executor.steps.pack_sampled(out), FakeCopyEvent(query, synchronize))

    monkeypatch.setattr(executor.steps._Readback, "start", staticmethod(start))


def raising(message: str):
    def fail():
        raise RuntimeError(message)

    return fail


def test_a_device_failure_that_shows_as_the_sample_is_read_back_fails_its_step(pipelined, monkeypatch):
    # On a GPU an asynchronous error surfaces at the first look at the device: pipelined, that is the
    # readback of the last step, after run() has returned; the event's query may raise it first.
    if not pipelined:
        pytest.skip("the CPU's order reads every sample back as it is drawn")
    read_back_behind(monkeypatch, raising("CUDA error: device-side assert triggered"), raising("CUDA error: device-side assert triggered"))
    assert "device-side assert" in lone_step_refused()


def test_a_readback_that_fails_while_the_next_step_runs_fails_its_own_step(pipelined, monkeypatch):
    if not pipelined:
        pytest.skip("the CPU's order reads every sample back as it is drawn")
    read_back_behind(monkeypatch, lambda: False, raising("CUDA error: an illegal memory access was encountered"))
    answers, message = failed_follower(GatedModel(0, 1))
    assert answers == [(1, Reject)]  # step 1's sample failed, found as step 2 ran: step 1 is named
    assert "illegal memory access" in message


def test_a_sample_read_back_behind_an_event_answers_as_the_cpus_own(pipelined, monkeypatch):
    # The device's packing, copy and unpacking (pack_sampled, unpack_sampled) give the RESULT the
    # CPU's arrays give, alternatives included.
    synced: list[int] = []
    if pipelined:
        read_back_behind(monkeypatch, lambda: True, lambda: synced.append(1))
    prepare = make_prepare([Seq(1, (20,), 0, (0,)), Seq(2, (30,), 0, (1,))], cleared=(0, 1))
    prepare = replace(prepare, num_logprobs=np.array([3, 0], dtype=np.uint8))
    code, endpoint, _ = run_worker([welcome(), frame(1, prepare), frame(1, Go()), frame(1, Shutdown("x"))], model=FixedLogits(0, 1))
    assert code == ExitCode.OK
    (result,) = [b for _, b in endpoint.replies() if isinstance(b, Result)]
    assert result.token_ids.tolist() == [10, 10] and result.finite.tolist() == [1, 1]
    assert result.top_token_ids.tolist()[:2] == [10, 11] and len(result.top_token_ids) == 3
    assert np.isfinite(result.logprobs).all() and result.logprobs[0] == result.top_logprobs[0]
    assert synced == ([1] if pipelined else [])


def test_a_gpus_sample_is_copied_into_pinned_memory_behind_an_event_on_its_stream(monkeypatch, pipelined):
    # What _Readback.start asks of CUDA, with torch's CUDA calls stood in on the CPU: one copy of the
    # packed sample into pinned memory, queued (non_blocking), an event recorded on the current
    # stream of the sample's device after it, and take() waiting on that event before unpacking.
    if not pipelined:
        pytest.skip("the same in either order")
    calls: list[tuple] = []
    packed = executor.steps.pack_sampled(
        executor.steps.SampleOutput(torch.tensor([7, 9]), torch.tensor([-0.5, -1.5]), torch.tensor([True, False]))
    )
    monkeypatch.setattr(executor.steps, "pack_sampled", lambda out: packed)
    empty = torch.empty

    def pinned(shape, dtype, pin_memory):
        calls.append(("empty", tuple(shape), dtype, pin_memory))
        return empty(shape, dtype=dtype)

    class Event:
        def record(self, stream):
            calls.append(("record", stream))

        def synchronize(self):
            calls.append(("synchronize",))

    copy_ = torch.Tensor.copy_

    def copying(self, source, non_blocking=False):
        calls.append(("copy", non_blocking))
        return copy_(self, source)

    monkeypatch.setattr(torch, "empty", pinned)
    monkeypatch.setattr(torch.Tensor, "copy_", copying)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: ("stream of", device))
    on_gpu = SimpleNamespace(device=torch.device("cuda", 1), shape=(2,))
    readback = executor.steps._Readback.start(None, SimpleNamespace(token_ids=on_gpu))
    assert calls == [("empty", tuple(packed.shape), torch.float64, True), ("copy", True), ("record", ("stream of", packed.device))]
    host = readback.take()
    assert calls[-1] == ("synchronize",)
    assert host.tokens.tolist() == [7, 9] and host.finite.tolist() == [1, 0] and host.logprobs.tolist() == [-0.5, -1.5]


def test_a_whole_sampling_state_on_a_feedback_row_counts_the_fed_token(pipelined, monkeypatch):
    # The fed token is the host copy of the step before's sample: pipelined, taken only as this
    # step's first forward is queued, before its sampling states are built.
    if pipelined:
        read_back_behind(monkeypatch, lambda: False, lambda: None)
    s1 = with_presence(make_prepare([Seq(1, (20,), 0, (0,))], cleared=(0,)), 1)
    s2 = with_presence(make_prepare([Seq(1, (0,), 1, (0,), held=1, feedback=True)]), 1, ())
    s3 = with_presence(make_prepare([Seq(1, (0,), 2, (0,), held=1, feedback=True)]), 1, (10,))
    script = [
        welcome(), frame(1, s1), frame(1, Go()), frame(2, s2), frame(2, Go()), frame(3, s3), frame(3, Go()),
        frame(3, Shutdown("done")),
    ]  # fmt: skip
    code, endpoint, _ = run_worker(script, model=FixedLogits(0, 1))
    assert code == ExitCode.OK
    results = {s: b.token_ids.tolist() for s, b in endpoint.replies() if isinstance(b, Result)}
    # Step 2 sends an empty output, and its feedback row brings 10: penalized, 11. Step 3 sends [10]
    # and is fed 11: both penalized, 10 again.
    assert results == {1: [10], 2: [11], 3: [10]}


def record_clears(worker, cleared_where: list[tuple[str, int]]) -> None:
    """Wraps the worker's cache so that each page cleared is listed with the thread that cleared it:
    "model" (clear_pages) or "ahead" (the link thread's clear_pages_beside)."""
    cache = worker.runner.cache
    clear, clear_beside = cache.clear_pages, cache.clear_pages_beside

    def clearing(pages):
        cleared_where.extend(("model", int(p)) for p in pages)
        clear(pages)

    def clearing_ahead(pages):
        cleared_where.extend(("ahead", int(p)) for p in pages)
        clear_beside(pages)

    cache.clear_pages, cache.clear_pages_beside = clearing, clearing_ahead


def test_a_step_staged_before_the_step_ahead_of_it_ran_its_cache_operations_is_cleared_by_the_model():
    # Step 3 clears page 7, which step 2 offloads first. Step 3 is staged while step 1's forward
    # holds the model's thread and step 2 waits behind it: a clear on the link thread there would
    # zero page 7 before step 2's offload read it (executor/clear_ahead.py).
    model = GatedModel(0, 1)
    caches: list = []
    cleared_where: list[tuple[str, int]] = []

    def record(worker):
        worker.runner.cache.data[7] = 3.0
        caches.append(worker.runner.cache)
        record_clears(worker, cleared_where)

    endpoint, thread, codes = start_worker(model, before_start=record)
    endpoint.push(welcome(), frame(1, make_prepare([Seq(1, (20,), 0, (0,))], cleared=(0,))), frame(1, Go()))
    assert model.entered.wait(10)
    endpoint.push(frame(2, make_prepare([Seq(2, (30,), 0, (1,))], cleared=(1,), offload=((7, 0),))), frame(2, Go()))
    endpoint.wait_for(lambda r: r[0] == 2 and isinstance(r[1], Ready))
    endpoint.push(frame(3, make_prepare([Seq(3, (40,), 0, (7,))], cleared=(7,))), frame(3, Go()))
    endpoint.wait_for(lambda r: r[0] == 3 and isinstance(r[1], Ready))
    model.gate.set()
    endpoint.wait_for(lambda r: r[0] == 3 and isinstance(r[1], Result))
    endpoint.push(frame(3, Shutdown("done")))
    thread.join(10)
    assert codes == [ExitCode.OK]
    assert [s for s, b in endpoint.replies() if isinstance(b, Result)] == [1, 2, 3]
    assert bool((caches[0].host[0] == 3.0).all()), "step 2's offload read page 7 before step 3's clear"
    assert cleared_where == [("model", 0), ("model", 1), ("model", 7)]


def test_a_step_handed_to_an_idle_model_thread_is_cleared_by_it():
    # Nothing runs when step 2's GO comes: the model's thread takes it at once and clears its page
    # with torch's threads, where the link thread's one-thread memset would make it wait.
    model = GatedModel(0, 1)
    model.gate.set()
    cleared_where: list[tuple[str, int]] = []
    endpoint, thread, codes = start_worker(model, before_start=lambda worker: record_clears(worker, cleared_where))
    endpoint.push(welcome(), frame(1, make_prepare([Seq(1, (20,), 0, (0,))], cleared=(0,))), frame(1, Go()))
    endpoint.wait_for(lambda r: r[0] == 1 and isinstance(r[1], Result))
    endpoint.push(frame(2, make_prepare([Seq(2, (30,), 0, (4,))], cleared=(4,))), frame(2, Go()))
    endpoint.wait_for(lambda r: r[0] == 2 and isinstance(r[1], Result))
    endpoint.push(frame(2, Shutdown("done")))
    thread.join(10)
    assert codes == [ExitCode.OK]
    assert cleared_where == [("model", 0), ("model", 4)]


def test_a_step_run_and_its_answer_are_freed_on_the_links_thread(monkeypatch):
    """Freeing a step's inputs took ~150 us of the model's thread between two frames (SchedulerLink
    .release): every step but the last, and what its answer holds, is freed on the link's thread."""
    import weakref

    from executor.link import SchedulerLink, link_thread_name

    freed: dict[int, str] = {}
    build = SchedulerLink._build

    def building(link, checked):
        staged = build(link, checked)
        step = staged.step
        weakref.finalize(staged, lambda: freed.__setitem__(("staged", step), threading.current_thread().name))
        weakref.finalize(staged.inputs, lambda: freed.__setitem__(("inputs", step), threading.current_thread().name))
        return staged

    monkeypatch.setattr(SchedulerLink, "_build", building)
    steps = [make_prepare([Seq(s, (20 + s,), 0, (s,))], cleared=(s,)) for s in range(1, 5)]
    script = [welcome()]
    for n, prepare in enumerate(steps, start=1):
        script += [frame(n, prepare), frame(n, Go())]
    code, endpoint, _ = run_worker([*script, frame(len(steps), Shutdown("done"))])
    assert code == ExitCode.OK
    assert len([b for _, b in endpoint.replies() if isinstance(b, Result)]) == len(steps)
    link = link_thread_name(0)
    early = {key: where for key, where in freed.items() if key[1] < len(steps)}
    assert len(early) == 2 * (len(steps) - 1) and set(early.values()) == {link}, freed


def test_rank_0_on_a_cpu_samples_into_the_outputs_made_where_the_step_was_staged(monkeypatch):
    from executor.link import SchedulerLink

    if executor.sampler._sampling is None:
        pytest.skip("executor/_sampling.c is not built: the passes make outputs of their own")

    staged_outputs = {}
    build = SchedulerLink._build

    def building(link, checked):
        staged = build(link, checked)
        staged_outputs[staged.step] = staged.outputs
        return staged

    monkeypatch.setattr(SchedulerLink, "_build", building)
    steps = [make_prepare([Seq(s, (20 + s,), 0, (s,)), Seq(10 + s, (5,), 0, (10 + s,))], cleared=(s, 10 + s)) for s in (1, 2)]
    script = [welcome(), frame(1, steps[0]), frame(1, Go()), frame(2, steps[1]), frame(2, Go()), frame(2, Shutdown("done"))]
    code, endpoint, _ = run_worker(script)
    assert code == ExitCode.OK
    results = {s: b for s, b in endpoint.replies() if isinstance(b, Result)}
    for step, result in results.items():
        (outputs,) = staged_outputs[step]  # one forward
        assert outputs.tokens.tolist() == result.token_ids.tolist() and outputs.finite.tolist() == result.finite.tolist(), step


@pytest.mark.parametrize(("device", "holding"), [("cpu", True), ("cuda", False)])
def test_a_rank_is_connected_with_a_link_woken_holding_the_gil_on_a_cpu_alone(monkeypatch, device: str, holding: bool) -> None:
    """On a CPU the model's thread wakes its link for each answer without giving the GIL up there
    (docs/control_plane.md, change 113); a GPU rank's, unmeasured, gives it up as before."""
    import protocol.transport

    class Connected(Exception):
        pass

    made = {}

    def endpoint(*args: object, **kwargs: object) -> None:
        made.update(kwargs)
        raise Connected

    monkeypatch.setattr(protocol.transport, "ExecutorEndpoint", endpoint)
    loaded = SimpleNamespace(rank=0, cache=SimpleNamespace(device=torch.device(device)))
    with pytest.raises(Connected):
        executor.worker.serve_executor(loaded, address="ipc:///nowhere", key=b"k" * 32, run_id="run")
    assert made["wake_holding_gil"] is holding
