"""The keyed frame fuzzer (frame_fuzz.py) as one run against live executors of a real model: two
ranks over gloo, driven by a FrameDriver that holds the launch's key. tests/executor/
test_frame_fuzz_live.py runs the same checks in a short form against a stand-in model; this is the
long form scripts/stress.py runs, with as many body mutations as it is asked for.

It takes the good step's tokens first, then sends every wire case and `examples` mutated PREPAREs,
checking each answer; afterwards both ranks must be up and answering, the good step must give the
same tokens, and SHUTDOWN must end both ranks with exit code 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed

from executor.options import ExecutorOptions
from protocol.auth import new_key
from protocol.transport import SchedulerEndpoint, ipc_address
from scripts.harness.executors import ExecutorCluster
from scripts.harness.frame_driver import FrameDriver
from scripts.harness.frame_fuzz import (
    BodyMutation,
    body_mutations,
    check_body_outcome,
    check_good_step,
    check_wire_outcome,
    good_prepare,
    wire_cases,
)

WORLD = 2
RUN_ID = "stress-frame-fuzz"
REAL_MODEL_LOAD = "executor.model:load_model"


@dataclass
class FrameFuzzReport:
    wire_cases: int = 0
    mutations: int = 0
    answers: dict[str, int] = field(default_factory=dict)  # first answer's code (or READY) -> count
    failures: list[str] = field(default_factory=list)
    good_tokens_before: list[int] = field(default_factory=list)
    good_tokens_after: list[int] = field(default_factory=list)
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    rss_mib_start: dict[str, float] = field(default_factory=dict)
    rss_mib_end: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    passed: bool = False


def executor_options(model: str) -> ExecutorOptions:
    """A small cache, so that the geometry's limits (and one past them) are cheap to reach."""
    return ExecutorOptions(
        model=model, num_kv_pages=32, page_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
        kv_cache_dtype="fp32", dtype="fp32", num_host_pages=4, device="cpu", debug_poison_cache=True,
        debug_poison_freed=True, heartbeat_interval_s=0.2, peer_timeout_s=10.0, handshake_timeout_s=120.0,
    )  # fmt: skip


def _mib(sizes: dict[str, int]) -> dict[str, float]:
    return {label: round(size / 2**20, 1) for label, size in sorted(sizes.items())}


def fuzz_frames(model: str, examples: int, log_dir: Path, seed: int = 0) -> FrameFuzzReport:
    report = FrameFuzzReport()
    started = time.perf_counter()
    endpoint = SchedulerEndpoint(ipc_address(), new_key(), RUN_ID)
    cluster = ExecutorCluster(
        WORLD, address=endpoint.address, key=endpoint._stamp.key, run_id=RUN_ID, options=executor_options(model),
        load=REAL_MODEL_LOAD, log_dir=log_dir, log_level="ERROR",
    )  # fmt: skip
    try:
        cluster.start()
        driver = FrameDriver(endpoint, WORLD)
        geometry = driver.handshake().geometry
        good = good_prepare(geometry)
        report.good_tokens_before, problems = check_good_step(driver.step(good), None)
        report.failures += problems
        report.rss_mib_start = _mib(cluster.rss())
        for case in wire_cases(geometry):
            sent = driver.send_parts(case.build(driver, driver.next_step, good), answered=case.answered)
            report.failures += [f"wire {case.name}: {p}" for p in check_wire_outcome(case, sent, WORLD)]
            report.wire_cases += 1

        @hypothesis_seed(seed)
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(mutation=body_mutations(geometry))
        def one(mutation: BodyMutation) -> None:
            sent = driver.send_parts([driver.stamp(mutation.prepare, driver.next_step)])
            report.mutations += 1
            report.failures += [f"{mutation.describe()}: {p}" for p in check_body_outcome(mutation, sent, geometry, WORLD)]
            first = sent.answers[0][0] if sent.answers.get(0) else None
            answer = "none" if first is None else first.code.name if first.code else "READY"
            report.answers[answer] = report.answers.get(answer, 0) + 1

        one()
        if len(cluster.survivors()) != WORLD:
            report.failures.append("a rank exited during the fuzzing")
        silent = driver.silent_ranks(within_s=3.0)
        if silent:
            report.failures.append(f"ranks {silent} fell silent")
        report.good_tokens_after, problems = check_good_step(driver.step(good), report.good_tokens_before)
        report.failures += problems
        report.rss_mib_end = _mib(cluster.rss())
        driver.shutdown("the fuzzing is over")
        report.exit_codes = cluster.stop(grace_s=15)
        if report.exit_codes != {0: 0, 1: 0}:
            report.failures.append(f"exit codes at SHUTDOWN: {report.exit_codes}")
    except Exception as exc:  # noqa: BLE001 - a driver error (a rank gone, no answer) is the finding
        report.failures.append(f"{type(exc).__name__}: {exc}")
    finally:
        cluster.stop()
        endpoint.close()
    report.seconds = round(time.perf_counter() - started, 2)
    report.passed = not report.failures and report.mutations > 0
    return report
