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
from protocol.frames import (
    LAYOUT_VERSION,
    Abort,
    Done,
    Frame,
    Go,
    Heartbeat,
    Hello,
    Prepare,
    Ready,
    Reject,
    Result,
    Shutdown,
    Welcome,
)
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
    endpoint: SchedulerEndpoint
    procs: list[subprocess.Popen]
    logs: list[Path]
    ranks: list[int]
    last_seen: dict[int, float]
    welcomed: bool = False

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def beat(self) -> None:
        """The scheduler's idle heartbeat, to every rank still believed alive."""
        for rank in list(self.ranks):
            try:
                self.endpoint.send(rank, Heartbeat(rank=-1), step=0)
            except TransportError:
                self.ranks.remove(rank)

    def collect(self, timeout_s: float = 20.0) -> dict[int, Frame]:
        """One non-heartbeat frame from every live rank, heartbeating meanwhile."""
        got: dict[int, Frame] = {}
        deadline = time.monotonic() + timeout_s
        next_beat = 0.0
        while set(got) != set(self.ranks):
            now = time.monotonic()
            assert now < deadline, f"ranks {sorted(set(self.ranks) - set(got))} did not answer; got {got}"
            if now >= next_beat and self.welcomed:
                self.beat()
                next_beat = now + HEARTBEAT_S
            received = self.endpoint.recv(50)
            if received is None:
                continue
            assert received.error is None, f"rank {received.rank} sent a bad frame: {received.error}"
            self.last_seen[received.rank] = time.monotonic()
            if not isinstance(received.frame.body, Heartbeat):
                got[received.rank] = received.frame
        return got

    def handshake(self) -> dict[int, Frame]:
        hellos = self.collect(timeout_s=60.0)
        assert all(isinstance(f.body, Hello) for f in hellos.values())
        version = negotiate_version(hellos[0].body.versions)
        welcome = Welcome(version, LAYOUT_VERSION, len(self.procs), hellos[0].body.geometry)
        self.endpoint.send_all(self.ranks, welcome, step=0)
        self.endpoint.version = version
        self.welcomed = True
        return hellos

    def step(self, step: int, prepare: Prepare) -> dict[int, Frame]:
        """PREPARE to all; GO if every rank is READY, else ABORT. Returns the last answers."""
        self.endpoint.send_all(self.ranks, prepare, step=step)
        answers = self.collect()
        if all(isinstance(f.body, Ready) for f in answers.values()):
            self.endpoint.send_all(self.ranks, Go(), step=step)
            return self.collect()
        self.endpoint.send_all(self.ranks, Abort("a rank rejected the step"), step=step)
        return answers

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
        yield Cluster(endpoint, executors.processes, logs, list(range(world_size)), {})
    finally:
        executors.stop()
        endpoint.close()


def test_two_ranks_refuse_a_geometry_mismatch_at_the_handshake(tmp_path):
    other = lambda rank: base_options(num_kv_pages=32 if rank == 1 else GEOMETRY.num_kv_pages)  # noqa: E731
    with cluster(tmp_path, 2, other) as c:
        hellos = c.handshake()
        assert hellos[1].body.geometry.num_kv_pages == 32
        assert c.wait_exit(1, 20) == ExitCode.HANDSHAKE_REFUSED
        refusal = c.log(1)
        assert "[rank 1] handshake refused" in refusal and "num_kv_pages 16 (expected 32)" in refusal
        c.endpoint.send(0, Shutdown("rank 1 refused the geometry"), step=0)
        assert c.wait_exit(0, 20) == ExitCode.OK


def test_two_ranks_step_then_a_killed_rank_is_noticed_and_the_survivor_exits(tmp_path):
    with cluster(tmp_path, 2) as c:
        c.handshake()
        answers = c.step(1, make_prepare([Seq(4, (3, 4, 5), 0, (2,))], cleared=(2,)))
        assert isinstance(answers[1].body, Done)
        result = answers[0].body
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
        assert first[0].body.token_ids.tolist() == [5 + 6, 7 + 6]  # all_reduce over 3 ranks: 1 + 2 + 3
        assert first[0].body.finite.tolist() == [1, 1]
        assert [type(first[r].body) for r in (1, 2)] == [Done, Done]

        def assert_all_rejected(answers, step, code):
            for rank in range(3):
                body = answers[rank].body
                assert isinstance(body, Reject) and body.rank == rank, f"rank {rank}: {body}"
                assert (answers[rank].step, RejectCode(body.code)) == (step, code), body.message

        bad_page = make_prepare([Seq(1, (11,), 3, (0, GEOMETRY.num_kv_pages))])
        assert_all_rejected(c.step(2, bad_page), 2, RejectCode.PAGE_OUT_OF_RANGE)

        good = make_prepare([Seq(1, (11,), 3, (0,))])

        def send_raw(step, *, version=None, tamper=False):
            """A PREPARE stamped with another version or with a broken MAC, then ABORT."""
            negotiated = c.endpoint.version
            c.endpoint.version = version or negotiated
            parts = c.endpoint._stamp.encode(good, step)
            c.endpoint.version = negotiated
            if tamper:
                parts[-1] = bytes(b ^ 0xFF for b in parts[-1])
            c.endpoint._send_parts(c.ranks, parts)
            answers = c.collect()
            c.endpoint.send_all(c.ranks, Abort("a rank rejected the step"), step=step)
            return answers

        assert_all_rejected(send_raw(3, version=99), 3, RejectCode.BAD_VERSION)
        assert_all_rejected(send_raw(4, tamper=True), 4, RejectCode.BAD_MAC)

        last = c.step(5, good)
        assert isinstance(last[0].body, Result), last[0].body
        assert last[0].body.token_ids.tolist() == [11 + 6] and last[0].body.finite.tolist() == [1]

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
        c.endpoint.send_all([0, 1], Shutdown("rank 2 died"), step=5)
        assert c.wait_exit(0, 15) == ExitCode.OK
        assert c.wait_exit(1, 15) == ExitCode.OK
        assert "[rank 1] shutdown: rank 2 died" in c.log(1)
