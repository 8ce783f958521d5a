"""Recovery benchmark: how long a client waits when a rank dies or hangs under `tp-runtime serve`.

    python scripts/bench_recovery.py                 # default model, TP=2, 5 runs of each fault
    python scripts/bench_recovery.py --runs 1 --json
    python scripts/bench_recovery.py --hosts 2 --runs 5 --json --out /tmp/recovery-2hosts.json

One server takes every fault in turn (it restarts its executor group each time; --max-restarts is
raised so that the window never ends it): kill -9 of rank 1, kill -9 of rank 0, SIGSTOP of rank 1,
`--runs` times. Each fault strikes while a long stream runs (scripts/harness/recovery.py). Per
fault, from the signal, as medians over the runs:

    error_s        the stream in flight ends with its error event
    unhealthy_s    /health answers 503
    first_token_s  the first token of a greedy request sent once /health turned 503, which waited in
                   the queue for the new group (the fault-to-first-good-token time)
    healthy_s      /health answers 200 again

Every run must also pass: the error names the rank (the first rank it names is the one signalled),
the held request gets the same greedy tokens as before any fault, and the HTTP server is the same
process throughout. Exit code 0 when every run passed. The report goes to --out/report.json (or to
--out itself when it ends in .json, the logs then beside it in --out without the suffix) and, with
--json, to stdout.

With --hosts 2 the server is two "hosts" on this machine, as tests/e2e/test_multinode_recovery.py
runs them (scripts/harness/two_hosts.py: two launches with --nnodes 2, half the ranks each, node 0
serving HTTP, the operator's key directories made for the run, a fixed --frame-port), and the
faults go by host: kill -9 of the rank on host 1, kill -9 of the rank on host 0 (the frontend's),
SIGSTOP of the rank on host 1. Which global rank runs on which host is looked up before each fault
(c10d numbers the hosts anew at every rendezvous); each report says `host` and `rank`. A stopped
rank must be SIGKILLed by its own host's agent when node 0's agent enters the next rendezvous.

With --quiet-s S the faults wait until four streams have run back to back for S seconds without
one: the `quiet` part reports the longest a live rank went unheard
(tp_runtime_peer_longest_silence_seconds) against the silence that takes a rank for stopped, and
fails on any restart or error then (a false positive). Run it with the machine loaded, as the
test suite beside it loads it, to see the margin a busy machine leaves.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import sys
import tempfile
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
from scripts.harness.processes import descendants  # noqa: E402
from scripts.harness.recovery import RecoveryReport, complete, recover_from  # noqa: E402
from scripts.harness.runtime import FRONTEND, RuntimeServer, ServerOptions, exit_on_sigterm  # noqa: E402
from scripts.harness.two_hosts import TwoHostServer  # noqa: E402
from tp_runtime.step_loop import EngineTimeouts  # noqa: E402

FAULTS = ((1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGSTOP))  # (rank, signal); --hosts 2: (host, signal)
TIMES = ("error_s", "unhealthy_s", "first_token_s", "healthy_s")
REFERENCE = CompletionRequest(prompt_ids=(1, 9690, 314, 253, 3458, 30, 2), max_tokens=16, ignore_eos=True)
QUIET_STREAM = CompletionRequest(prompt_ids=(1, 9690, 314, 253, 3458, 30, 2), max_tokens=200, ignore_eos=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_recovery", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hosts", type=int, choices=(1, 2), default=1, help="2: two localhost hosts, tp/2 ranks each")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--runs", type=int, default=5, help="runs of each fault")
    p.add_argument("--quiet-s", type=float, default=0.0, help="seconds of streams without a fault first")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.hosts == 2 and (args.tp < 2 or args.tp % 2):
        p.error("--hosts 2 needs an even --tp (half the ranks on each host)")
    return args


def out_paths(out: Path | None) -> tuple[Path, Path]:
    """(the report's file, the directory of the logs): --out/report.json and --out, or --out itself
    when it names a .json file, the logs then in --out without its suffix."""
    if out is None:
        out = default_out_dir("recovery")
    if out.suffix == ".json":
        return out, out.with_suffix("")
    return out / "report.json", out


def first_rank_named(error: str | None) -> int | None:
    """The first rank an error names ("the connection of rank 1 on host vm closed ...")."""
    found = re.search(r"\brank (\d+)", error or "")
    return int(found.group(1)) if found else None


def check_named(report: RecoveryReport, rank: int) -> None:
    """The in-flight stream's error must come after the signal and name the signalled rank first
    (not a survivor's own error about it, such as rank 0's gloo read error after rank 1 died)."""
    if report.error_s is not None and report.error_s < 0:
        report.lost.append(f"the stream in flight ended {-report.error_s:.3f} s before the fault: {report.error!r}")
        return
    named = first_rank_named(report.error)
    if named != rank:
        report.lost.append(f"the error names {'no rank' if named is None else f'rank {named}'} first, not rank {rank}: {report.error!r}")


def rank_on_host(server: TwoHostServer, host: int, tp: int) -> int:
    """The lowest global rank that runs on `host` now."""
    return next(r for r in range(tp) if server.host_of(r) == host)


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
    report_path, out = out_paths(args.out)
    out.mkdir(parents=True, exist_ok=True)
    options = ServerOptions(
        model=args.model or default_model_path(), tensor_parallel_size=args.tp, dtype=args.dtype,
        extra_args=("--max-restarts", str(len(FAULTS) * args.runs + 1)),
    )  # fmt: skip
    reports: list[RecoveryReport] = []
    where: list[dict[str, int]] = []  # per report: the rank signalled (and its host, --hosts 2)
    keys_root: str | None = None
    if args.hosts == 2:
        from tp_runtime.frame_keys import create_key_dirs

        keys_root = tempfile.mkdtemp(prefix="bench-recovery-keys-")  # secrets: removed at the end
        dirs = create_key_dirs(str(Path(keys_root) / "out"), ["host0", "host1"])
        server: RuntimeServer = TwoHostServer(options, (str(dirs["host0"]), str(dirs["host1"])), out)
    else:
        server = RuntimeServer(options, log_path=out / "server.log")
    try:
        code, quiet = run_faults(args, server, reports, where)
        if code is not None and not reports:
            return code
    finally:
        if keys_root is not None:
            shutil.rmtree(keys_root, ignore_errors=True)
    result = {
        "model": options.model, "tp": args.tp, "hosts": args.hosts, "runs": args.runs, "medians": summarize(reports),
        "quiet": quiet, "ended_early": code is not None,
        "passed": code is None and all(r.passed for r in reports) and (quiet is None or bool(quiet["passed"])),
        "reports": [{**asdict(r), **w} for r, w in zip(reports, where, strict=True)],
    }  # fmt: skip
    write_json(report_path, result)
    sys.stderr.write(json.dumps(result["medians"], indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


def run_faults(
    args: argparse.Namespace, server: RuntimeServer, reports: list[RecoveryReport], where: list[dict[str, int]]
) -> tuple[int | None, dict[str, object] | None]:
    """Starts the server, puts it through every fault `args.runs` times, stops it. Returns (an exit
    code when it could not start or the reference request failed, else None; the quiet part)."""
    quiet: dict[str, object] | None = None
    with server:
        frontend_pid = server.process_of(FRONTEND).pid
        if isinstance(server, TwoHostServer) and frontend_pid not in descendants(server.pid):
            sys.stderr.write(f"bench_recovery: the frontend (pid {frontend_pid}) does not run on node 0\n")
            return 2, None
        expected = complete(server.url, served_model(server.url), REFERENCE)
        if not expected.completed:
            sys.stderr.write(f"bench_recovery: the reference request failed: {expected.error}\n")
            return 2, None
        if args.quiet_s > 0:
            quiet = quiet_phase(server, args.quiet_s)
            sys.stderr.write(f"quiet: {json.dumps(quiet)}\n")
        for run in range(args.runs):
            for target, sig in FAULTS:
                if server.process is not None and server.process.poll() is not None:
                    sys.stderr.write(f"bench_recovery: the server has exited (code {server.process.returncode}): no more faults\n")
                    return 1, quiet
                two_hosts = isinstance(server, TwoHostServer)
                rank = rank_on_host(server, target, args.tp) if two_hosts else target
                report = recover_from(server, rank, sig, REFERENCE, expected.token_ids)
                if two_hosts:
                    report.fault = f"{sig.name} host{target}"  # the rank on a host may change at a rendezvous
                where.append({"host": target, "rank": rank} if two_hosts else {"rank": rank})
                check_named(report, rank)
                if report.same_frontend and server.process_of(FRONTEND).pid != frontend_pid:
                    report.lost.append(f"the frontend is pid {server.process_of(FRONTEND).pid}, not {frontend_pid} as at the start")
                reports.append(report)
                times = ", ".join(f"{name} {getattr(report, name)}" for name in TIMES)
                label = f"{report.fault} (rank {rank})" if two_hosts else report.fault
                sys.stderr.write(f"run {run + 1}: {label}: {times}{'' if report.passed else ' FAILED ' + str(report.lost)}\n")
                if not report.passed:
                    sys.stderr.write(f"{server.log_tail(60)}\n")
    return None, quiet


if __name__ == "__main__":
    sys.exit(main())
