"""The step loop across real processes: 2 and 3 executors (gloo) and a scheduler-side driver.

The driver here plays the engine's part over a real SchedulerEndpoint; the executors run
run_executor with the stand-in model of executor_standin.py, started and stopped by pid by
scripts/harness/executors.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from executor.options import ExecutorOptions
from executor.worker import ExitCode
from protocol.auth import new_key
from protocol.errors import RejectCode, TransportError
from protocol.conversation import HandshakeComplete, Phase, SchedulerConversation, StepDone, StepReady, StepRefused
from protocol.frames import LAYOUT_VERSION, Hello, Prepare, Welcome
from protocol.transport import SchedulerEndpoint, ipc_address
from protocol.validate import negotiate_version
from scripts.harness.executors import ExecutorCluster
from tests.executor.executor_standin import Seq, geometry, make_prepare

RUN_ID = "loop-test"
HEARTBEAT_S = 0.2
GEOMETRY = geometry()

pytestmark = pytest.mark.timeout(120)


def base_options(**overrides) -> ExecutorOptions:
    options = ExecutorOptions(
        model="stand-in-v1",
        num_kv_pages=GEOMETRY.num_kv_pages,
        page_size=GEOMETRY.page_size,
        max_num_seqs=GEOMETRY.max_num_seqs,
        max_num_batched_tokens=GEOMETRY.max_num_batched_tokens,
        max_model_len=GEOMETRY.max_model_len,
        kv_cache_dtype=GEOMETRY.kv_dtype,
        dtype="fp32",
        num_host_pages=GEOMETRY.num_host_pages,
        device="cpu",
        debug_poison_cache=True,
        heartbeat_interval_s=HEARTBEAT_S,
        peer_timeout_s=3.0,
        handshake_timeout_s=60.0,
    )
    return replace(options, **overrides)


@dataclass
class Cluster:
    """The scheduler's side of the loop tests: the protocol's own conversation drives the handshake
    and the steps; only the frames a test breaks on purpose are sent raw."""

    endpoint: SchedulerEndpoint
    procs: list[subprocess.Popen]
    logs: list[Path]
    ranks: list[int]
    last_seen: dict[int, float]
    conversation: SchedulerConversation
    welcomed: bool = False

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def beat(self) -> None:
        """The scheduler's heartbeat, to every rank still believed alive."""
        for rank in list(self.ranks):
            try:
                self.endpoint.send(rank, *self.conversation.heartbeat())
            except TransportError:
                self.ranks.remove(rank)

    def events(self, until, timeout_s: float = 20.0) -> list[object]:
        """The conversation's events, heartbeating meanwhile, until `until(events)` holds."""
        got: list[object] = []
        deadline = time.monotonic() + timeout_s
        next_beat = 0.0
        while not until(got):
            now = time.monotonic()
            assert now < deadline, f"no answer in {timeout_s} s; events so far {got}"
            if now >= next_beat and self.welcomed:
                self.beat()
                next_beat = now + HEARTBEAT_S
            received = self.endpoint.recv(50)
            if received is None:
                continue
            self.last_seen[received.rank] = time.monotonic()
            got.extend(self.conversation.receive(received.rank, received.frame or received.error, time.monotonic()))
        return got

    def handshake(self) -> dict[int, Hello]:
        """Every HELLO; WELCOME when the conversation finds they agree (see handshake_raw)."""
        conv = self.conversation
        events = self.events(lambda got: conv.phase is not Phase.HANDSHAKE, timeout_s=60.0)
        assert isinstance(events[-1], HandshakeComplete), events
        self.endpoint.version = conv.version
        self.endpoint.send_all(self.ranks, *conv.welcome())
        self.welcomed = True
        return dict(conv.hellos)

    def handshake_raw(self) -> dict[int, Hello]:
        """Every HELLO, then WELCOME with rank 0's geometry whether or not the ranks agree: the
        scheduler's conversation would refuse first, and this tests the executors' own refusal."""
        events = self.events(lambda got: len(self.conversation.hellos) == len(self.procs), timeout_s=60.0)
        hellos = dict(self.conversation.hellos)
        assert len(hellos) == len(self.procs), events
        version = negotiate_version(hellos[0].versions)
        welcome = Welcome(version, LAYOUT_VERSION, len(self.procs), hellos[0].geometry)
        self.endpoint.send_all(self.ranks, welcome, step=0)
        self.endpoint.version = version
        return hellos

    def step(self, step: int, prepare: Prepare) -> object:
        """PREPARE to all; GO if every rank is READY, else ABORT. Returns the step's end: StepDone
        (with rank 0's RESULT, once every rank answered) or StepRefused (with every refusal)."""
        conv = self.conversation
        self.endpoint.send_all(self.ranks, *conv.prepare(step, prepare))
        return self.finish(step)

    def finish(self, step: int) -> object:
        conv = self.conversation
        answer = self.events(lambda got: any(isinstance(e, (StepReady, StepRefused)) for e in got))[-1]
        if isinstance(answer, StepRefused):
            self.endpoint.send_all(self.ranks, *conv.abort(step, "a rank rejected the step"))
            return answer
        self.endpoint.send_all(self.ranks, *conv.go(step))
        return self.events(lambda got: any(isinstance(e, StepDone) for e in got))[-1]

    def wait_exit(self, rank: int, timeout_s: float) -> int:
        return self.procs[rank].wait(timeout=timeout_s)


@contextmanager
def cluster(tmp_path: Path, world_size: int, options_of=lambda rank: base_options()):
    endpoint = SchedulerEndpoint(ipc_address(), new_key(), RUN_ID)
    executors = ExecutorCluster(
        world_size,
        address=endpoint.address,
        key=endpoint._stamp.key,
        run_id=RUN_ID,
        options=options_of,
        load="tests.executor.executor_standin:load_standin",
        log_dir=tmp_path,
    )
    try:
        executors.start()
        logs = [executors.log_path(rank) for rank in range(world_size)]
        conversation = SchedulerConversation(world_size=world_size, run_id=RUN_ID)
        yield Cluster(endpoint, executors.processes, logs, list(range(world_size)), {}, conversation)
    finally:
        executors.stop()
        endpoint.close()


def test_two_ranks_refuse_a_geometry_mismatch_at_the_handshake(tmp_path):
    other = lambda rank: base_options(num_kv_pages=32 if rank == 1 else GEOMETRY.num_kv_pages)  # noqa: E731
    with cluster(tmp_path, 2, other) as c:
        hellos = c.handshake_raw()
        assert hellos[1].geometry.num_kv_pages == 32
        assert c.wait_exit(1, 20) == ExitCode.HANDSHAKE_REFUSED
        refusal = c.log(1)
        assert "[rank 1] handshake refused" in refusal and "num_kv_pages 16 (expected 32)" in refusal
        c.endpoint.send(0, *c.conversation.shutdown("rank 1 refused the geometry"))
        assert c.wait_exit(0, 20) == ExitCode.OK


def test_two_ranks_step_then_a_killed_rank_is_noticed_and_the_survivor_exits(tmp_path):
    with cluster(tmp_path, 2) as c:
        c.handshake()
        done = c.step(1, make_prepare([Seq(4, (3, 4, 5), 0, (2,))], cleared=(2,)))
        assert isinstance(done, StepDone), done  # rank 0's RESULT and rank 1's DONE are both in
        result = done.result
        assert result.token_ids.tolist() == [5 + 3] and result.finite.tolist() == [1]

        os.kill(c.procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - c.last_seen[1] < 4 * HEARTBEAT_S:
            received = c.endpoint.recv(50)
            if received is not None:
                c.last_seen[received.rank] = time.monotonic()
        assert time.monotonic() - killed < 5.0, "a dead executor must be noticed within 5 s"
        # The driver falls silent, as a dead scheduler would: the survivor must not wait for ever.
        c.endpoint.close()
        assert c.wait_exit(0, 10) == ExitCode.SCHEDULER_SILENT
        assert "[rank 0] nothing from the scheduler" in c.log(0)


def test_three_ranks_rejects_abort_everywhere_and_the_next_step_runs(tmp_path):
    with cluster(tmp_path, 3) as c:
        c.handshake()
        first = c.step(1, make_prepare([Seq(1, (3, 4, 5), 0, (0,)), Seq(2, (7,), 0, (1,))], cleared=(0, 1)))
        assert isinstance(first, StepDone), first  # every rank finished: RESULT from 0, DONE from 1 and 2
        assert first.result.token_ids.tolist() == [5 + 6, 7 + 6]  # all_reduce over 3 ranks: 1 + 2 + 3
        assert first.result.finite.tolist() == [1, 1]

        def assert_all_rejected(refused, step, code):
            assert isinstance(refused, StepRefused) and refused.step == step, refused
            assert sorted(r.rank for r in refused.rejections) == [0, 1, 2]
            for rejection in refused.rejections:
                assert rejection.code == code, rejection.message

        bad_page = make_prepare([Seq(1, (11,), 3, (0, GEOMETRY.num_kv_pages))])
        assert_all_rejected(c.step(2, bad_page), 2, RejectCode.PAGE_OUT_OF_RANGE)

        good = make_prepare([Seq(1, (11,), 3, (0,))])

        def send_raw(step, *, version=None, tamper=False):
            """The conversation's PREPARE for `step`, sent stamped with another version or with a
            broken MAC; the ranks' refusals end it (ABORT)."""
            body, _ = c.conversation.prepare(step, good)
            negotiated = c.endpoint.version
            c.endpoint.version = version or negotiated
            message = c.endpoint._stamp.encode(body, step)
            c.endpoint.version = negotiated
            if tamper:  # the MAC's last byte ends the message
                message = message[:-1] + bytes([message[-1] ^ 0xFF])
            c.endpoint.send_message(c.ranks, message)
            return c.finish(step)

        assert_all_rejected(send_raw(3, version=99), 3, RejectCode.BAD_VERSION)
        assert_all_rejected(send_raw(4, tamper=True), 4, RejectCode.BAD_MAC)

        last = c.step(5, good)
        assert isinstance(last, StepDone), last
        assert last.result.token_ids.tolist() == [11 + 6] and last.result.finite.tolist() == [1]

        os.kill(c.procs[2].pid, signal.SIGKILL)
        killed = time.monotonic()
        noticed = None
        while noticed is None and time.monotonic() - killed < 5.0:
            c.beat()  # a send to a vanished rank fails: ROUTER_MANDATORY
            if 2 not in c.ranks or time.monotonic() - c.last_seen[2] > 4 * HEARTBEAT_S:
                noticed = time.monotonic() - killed
            received = c.endpoint.recv(50)
            if received is not None:
                c.last_seen[received.rank] = time.monotonic()
        assert noticed is not None, "a dead executor must be noticed within 5 s"
        c.endpoint.send_all([0, 1], *c.conversation.shutdown("rank 2 died"))
        assert c.wait_exit(0, 15) == ExitCode.OK
        assert c.wait_exit(1, 15) == ExitCode.OK
        assert "[rank 1] shutdown: rank 2 died" in c.log(1)
