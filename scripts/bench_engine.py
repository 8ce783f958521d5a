"""The engine thread's own CPU per generated token, with no model beside it.

    python scripts/bench_engine.py                          # concurrency 1 and 8, a 15 ms step
    python scripts/bench_engine.py --concurrency 1 4 8 --step-ms 5 --tokens 200 --json
    python scripts/bench_engine.py --no-async-scheduling     # each step planned after the one before ends
    python scripts/bench_engine.py --calls                   # and the engine thread's calls per step

The real Engine (scheduler, step loop, conversation, transport, hand-off) serves streams against
tests/server/fake_rank.py's rank 0, a thread that answers each PREPARE as a real lone rank does
(READY, or READY in the RESULT of the step it runs) and each step --step-ms after it starts with a
RESULT; so nothing but the control plane runs in this process. Reported per level:
the engine thread's CPU time (its own CPU clock, exact) per output token and per step, and the
wall time per step. The fake rank's geometry runs at most 8 sequences per step. On a served model
the same code runs with caches that the forward has just flushed and costs several times more
(docs/control_plane.md); this measures the count of work, the served benchmark
(scripts/bench_serving.py) its price. `--calls` adds, from a second pass of each level, the count
itself: the Python and C calls the engine thread makes per step, which no noise on a shared machine
moves.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocol.frames import max_decode_steps  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402
from tests.server.fake_rank import GEOMETRY, running_engine  # noqa: E402
from tp_runtime.config import DEFAULT_SCHEDULER_STEPS  # noqa: E402
from tp_runtime.engine import Engine  # noqa: E402


class CallCounter:
    """Counts the calls of the thread it profiles (sys.setprofile's call and c_call events)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, frame: object, event: str, arg: object) -> None:
        if event == "call" or event == "c_call":
            self.calls += 1


@contextmanager
def counting_engine_calls() -> Iterator[CallCounter]:
    """A CallCounter installed in every engine thread started meanwhile: the engine's loop runs
    under it, and nothing else in this process does."""
    counter, run = CallCounter(), Engine._run

    def counted_run(self: Engine) -> None:
        sys.setprofile(counter)
        try:
            run(self)
        finally:
            sys.setprofile(None)

    Engine._run = counted_run
    try:
        yield counter
    finally:
        Engine._run = run


def _settled_stats(engine: object, generated: int) -> object:
    """The engine's published stats once they count `generated` tokens: the snapshot is published
    when the loop goes idle, a moment after the last token reached its stream."""
    deadline = time.monotonic() + 10
    while (stats := engine.stats()).tokens_generated_total < generated:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine's stats count {stats.tokens_generated_total} tokens, not {generated}")
        time.sleep(0.005)
    return stats


def measure(
    concurrency: int, tokens: int, step_ms: float, inflight: int = 2, counter: CallCounter | None = None,
    forwards: int = 1,
) -> dict[str, float]:
    """One level. With `counter` (counting_engine_calls'), the calls of the same window instead of
    its times, which the counting slows. forwards: --num-scheduler-steps (step_ms is per forward)."""
    with running_engine(step_delay_s=step_ms / 1000, max_inflight_steps=inflight, num_scheduler_steps=forwards) as engine:
        warm = sum(len(e.token_ids) for e in engine.submit([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True)))
        clock = time.pthread_getcpuclockid(engine._thread.ident)
        steps_before = _settled_stats(engine, warm).scheduler.steps_total
        counts = [0] * concurrency

        def stream(i: int) -> None:
            for event in engine.submit([5, 6, 8 + i], SamplingParams(max_tokens=tokens, ignore_eos=True)):
                counts[i] += len(event.token_ids)

        readers = [threading.Thread(target=stream, args=(i,)) for i in range(concurrency)]
        calls0 = counter.calls if counter else 0
        cpu0, wall0 = time.clock_gettime(clock), time.perf_counter()
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()
        cpu, wall = time.clock_gettime(clock) - cpu0, time.perf_counter() - wall0
        total = sum(counts)
        steps = _settled_stats(engine, warm + total).scheduler.steps_total - steps_before
        calls = counter.calls - calls0 if counter else 0
    if counter:
        return {
            "concurrency": concurrency, "steps": steps, "engine_calls_per_step": round(calls / steps),
            "engine_calls_per_token": round(calls / total, 1),
        }
    return {
        "concurrency": concurrency,
        "tokens": total,
        "steps": steps,
        "engine_cpu_us_per_token": round(cpu / total * 1e6, 1),
        "engine_cpu_us_per_step": round(cpu / steps * 1e6, 1),
        "wall_ms_per_step": round(wall / steps * 1e3, 3),
    }


def add_fake_rank_options(p: argparse.ArgumentParser) -> None:
    """The workload options of a benchmark against the fake rank (this one and bench_http.py)."""
    p.add_argument("--concurrency", type=int, nargs="+", default=(1, GEOMETRY.max_num_seqs))
    p.add_argument("--tokens", type=int, default=200, help="output tokens per stream")
    p.add_argument("--step-ms", type=float, default=15.0, help="the fake rank's time per forward")
    p.add_argument(
        "--num-scheduler-steps", type=int, default=min(DEFAULT_SCHEDULER_STEPS, max_decode_steps(GEOMETRY.page_size)),
        help="the server's: forwards a steady decode step runs on one frame, 1 to the fake rank's page size "
        "(default: the server's)",
    )


def check_fake_rank_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if min(args.concurrency) < 1 or max(args.concurrency) > GEOMETRY.max_num_seqs:
        p.error(f"--concurrency must be 1 to {GEOMETRY.max_num_seqs}, the fake rank's sequences per step")
    most = max_decode_steps(GEOMETRY.page_size)
    if not 1 <= args.num_scheduler_steps <= most:
        p.error(f"--num-scheduler-steps must be 1 to {most}, as the fake rank's page size allows")
    if not 2 <= args.tokens <= 200:
        p.error("--tokens must be 2 to 200 (the fake rank's max_model_len is 256)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_fake_rank_options(p)
    p.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
        help="plan each step while the one before runs, as the server does by default (off: in series)",
    )
    p.add_argument("--calls", action="store_true", help="also count the engine thread's calls per step")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    check_fake_rank_options(p, args)
    inflight = 2 if args.async_scheduling else 1
    forwards = args.num_scheduler_steps
    levels = [measure(c, args.tokens, args.step_ms, inflight, forwards=forwards) for c in args.concurrency]
    if args.calls:
        with counting_engine_calls() as counter:
            for level in levels:
                counted = measure(level["concurrency"], args.tokens, args.step_ms, inflight, counter, forwards)
                level["engine_calls_per_step"] = counted["engine_calls_per_step"]
                level["engine_calls_per_token"] = counted["engine_calls_per_token"]
    if args.json:
        report = {"step_ms": args.step_ms, "async_scheduling": args.async_scheduling, "num_scheduler_steps": forwards}
        print(json.dumps({**report, "levels": levels}))
    else:
        for level in levels:
            print(
                f"c={level['concurrency']:<3} {level['engine_cpu_us_per_token']:8.1f} us CPU/token "
                f"{level['engine_cpu_us_per_step']:8.1f} us CPU/step {level['wall_ms_per_step']:7.2f} ms/step"
                + (
                    f" {level['engine_calls_per_step']:6d} calls/step {level['engine_calls_per_token']:6.1f} calls/token"
                    if "engine_calls_per_step" in level else ""
                )
            )


if __name__ == "__main__":
    main()
