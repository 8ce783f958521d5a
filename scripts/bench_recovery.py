"""Recovery benchmark: how long a client waits when a rank dies or hangs under `tp-runtime serve`.

    python scripts/bench_recovery.py                 # default model, TP=2, 5 runs of each fault
    python scripts/bench_recovery.py --runs 1 --json

One server takes every fault in turn (it restarts its executor group each time; --max-restarts is
raised so that the window never ends it): kill -9 of rank 1, kill -9 of rank 0, SIGSTOP of rank 1,
`--runs` times. Each fault strikes while a long stream runs (scripts/harness/recovery.py). Per
fault, from the signal, as medians over the runs:

    error_s        the stream in flight ends with its error event
    unhealthy_s    /health answers 503
    first_token_s  the first token of a greedy request sent once /health turned 503, which waited in
                   the queue for the new group (the fault-to-first-good-token time)
    healthy_s      /health answers 200 again

Every run must also pass: the error names the rank, the held request gets the same greedy tokens as
before any fault, and the HTTP server is the same process throughout. Exit code 0 when every run
passed. The report goes to --out/report.json and, with --json, to stdout.

With --quiet-s S the faults wait until four streams have run back to back for S seconds without
one: the `quiet` part reports the longest a live rank went unheard
(tp_runtime_peer_longest_silence_seconds) against the silence that takes a rank for stopped, and
fails on any restart or error then (a false positive). Run it with the machine loaded, as the
test suite beside it loads it, to see the margin a busy machine leaves.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:  # run as a file: the checkout's root makes `scripts` importable
    sys.path.insert(0, REPO_ROOT)

from scripts.harness.client import BackgroundStreams, CompletionRequest, served_model  # noqa: E402
from scripts.harness.metrics import M_EXECUTOR_RESTARTS, M_PEER_LONGEST_SILENCE, read_metrics  # noqa: E402
from scripts.harness.output import default_out_dir, write_json  # noqa: E402
from scripts.harness.recovery import RecoveryReport, complete, recover_from  # noqa: E402
from scripts.harness.runtime import RuntimeServer, ServerOptions, exit_on_sigterm  # noqa: E402
from tp_runtime.step_loop import EngineTimeouts  # noqa: E402

FAULTS = ((1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGSTOP))
TIMES = ("error_s", "unhealthy_s", "first_token_s", "healthy_s")
REFERENCE = CompletionRequest(prompt_ids=(1, 9690, 314, 253, 3458, 30, 2), max_tokens=16, ignore_eos=True)
QUIET_STREAM = CompletionRequest(prompt_ids=(1, 9690, 314, 253, 3458, 30, 2), max_tokens=200, ignore_eos=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_recovery", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--runs", type=int, default=5, help="runs of each fault")
    p.add_argument("--quiet-s", type=float, default=0.0, help="seconds of streams without a fault first")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def quiet_phase(server: RuntimeServer, seconds: float) -> dict[str, object]:
    """Four streams at a time, back to back, for `seconds`, with no fault: nothing may fail or restart."""
    model = served_model(server.url)
    deadline = time.monotonic() + seconds
    streams = errors = 0
    while time.monotonic() < deadline:
        results = BackgroundStreams(server.url, model, [QUIET_STREAM] * 4, timeout_s=600).start().join()
        streams += len(results)
        errors += sum(r.error is not None for r in results)
    metrics = read_metrics(server.url) or {}
    restarts = metrics.get(M_EXECUTOR_RESTARTS)
    return {
        "seconds": seconds, "streams": streams, "errors": errors, "restarts": restarts,
        "longest_silence_s": metrics.get(M_PEER_LONGEST_SILENCE), "peer_silence_s": EngineTimeouts().peer_silence_s,
        "passed": errors == 0 and restarts == 0,
    }  # fmt: skip


def summarize(reports: Sequence[RecoveryReport]) -> dict[str, dict[str, float | None]]:
    """fault -> time -> the median over its runs (None when a run lacks it)."""
    summary: dict[str, dict[str, float | None]] = {}
    for fault in dict.fromkeys(r.fault for r in reports):
        runs = [r for r in reports if r.fault == fault]
        summary[fault] = {}
        for name in TIMES:
            values = [getattr(r, name) for r in runs]
            summary[fault][name] = None if None in values else round(statistics.median(values), 2)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    from executor.model import default_model_path

    args = parse_args(argv)
    exit_on_sigterm()
    out = args.out or default_out_dir("recovery")
    options = ServerOptions(
        model=args.model or default_model_path(), tensor_parallel_size=args.tp, dtype=args.dtype,
        extra_args=("--max-restarts", str(len(FAULTS) * args.runs + 1)),
    )  # fmt: skip
    reports: list[RecoveryReport] = []
    quiet: dict[str, object] | None = None
    with RuntimeServer(options, log_path=out / "server.log") as server:
        expected = complete(server.url, served_model(server.url), REFERENCE)
        if not expected.completed:
            sys.stderr.write(f"bench_recovery: the reference request failed: {expected.error}\n")
            return 2
        if args.quiet_s > 0:
            quiet = quiet_phase(server, args.quiet_s)
            sys.stderr.write(f"quiet: {json.dumps(quiet)}\n")
        for run in range(args.runs):
            for rank, sig in FAULTS:
                report = recover_from(server, rank, sig, REFERENCE, expected.token_ids)
                reports.append(report)
                times = ", ".join(f"{name} {getattr(report, name)}" for name in TIMES)
                sys.stderr.write(f"run {run + 1}: {report.fault}: {times}{'' if report.passed else ' FAILED ' + str(report.lost)}\n")
    result = {
        "model": options.model, "tp": args.tp, "runs": args.runs, "medians": summarize(reports), "quiet": quiet,
        "passed": all(r.passed for r in reports) and (quiet is None or bool(quiet["passed"])),
        "reports": [asdict(r) for r in reports],
    }  # fmt: skip
    write_json(out / "report.json", result)
    sys.stderr.write(json.dumps(result["medians"], indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
