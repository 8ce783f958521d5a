"""One fault against a fresh server while long streams run: SIGSTOP of a rank, or SIGKILL of one
process (the launcher, a rank, the frontend). What every such fault must leave, as
tests/e2e/test_sigstop.py and test_kill9.py check it one by one:

- every in-flight stream ends with an error, none completes and none hangs; where the HTTP server
  lives on (every target but the frontend) the error comes as an event, then its [DONE]; after a
  SIGSTOP the error names the stopped rank;
- after a SIGSTOP, /health leaves 200 within the peer-silence window;
- every process of the server exits (checked by pid, orphans included), the ipc directory is
  removed and the port can be bound again at once.

`run_fault` starts the server with --max-restarts 0 (a failed rank ends it: scripts/harness/
recovery.py checks the restarts), runs the fault and returns a `FaultReport`: what was lost, the
times to notice and to end, RSS per process before the fault.
"""

from __future__ import annotations

import signal
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from scripts.harness.client import BackgroundStreams, CompletionRequest, served_model
from scripts.harness.processes import bind_error
from scripts.harness.runtime import FRONTEND, RuntimeServer, ServerOptions

STREAM_TOKENS = 1500  # far more than a stream makes before the fault is noticed
NO_RESTARTS = ("--max-restarts", "0")
GONE_S = 20.0  # a rank notices a dead peer within its peer timeout (5 s); a drain takes 2 s


@dataclass
class FaultReport:
    name: str
    target: str  # the process's label
    signal: str
    streams: int = 0
    ended_with_error: int = 0  # as the fault requires (an event and [DONE] where HTTP lives on)
    lost: list[str] = field(default_factory=list)  # streams that completed, hung or ended wrongly
    health_after_s: float | None = None  # SIGSTOP: when /health left 200
    health_status: int | None = None
    streams_ended_s: float | None = None  # the last stream's end, after the signal
    gone_s: float | None = None  # every process exited, after the signal
    left: list[str] = field(default_factory=list)  # processes alive at GONE_S
    ipc_dirs_left: list[str] = field(default_factory=list)
    port: str = ""  # "free", or why it cannot be bound
    rss_mib: dict[str, float] = field(default_factory=dict)  # before the fault
    seconds: float = 0.0  # the whole run, the server's start included
    passed: bool = False


def _judge(report: FaultReport, target: str, stop: bool, rank: int | None, results: list) -> None:
    for i, result in enumerate(results):
        wrong = []
        if result.completed or result.error is None:
            wrong.append(f"ended without an error ({result.finish_reason})")
        elif target != FRONTEND and (result.error.startswith("transport") or result.done_markers != 1):
            wrong.append(f"no error event and [DONE]: {result.error}, [DONE] x{result.done_markers}")
        elif stop and not (f"rank {rank}" in result.error and "stopped answering" in result.error):
            wrong.append(f"the error does not name rank {rank}: {result.error}")
        if wrong:
            report.lost.append(f"stream {i}: {'; '.join(wrong)}")
        else:
            report.ended_with_error += 1


def run_fault(
    options: ServerOptions, target: str, sig: signal.Signals, log_dir: Path, streams: int = 3, notice_s: float = 6.5
) -> FaultReport:
    """Signals `target` (`launcher`, `rank0`, `rank1`, `frontend`) of a fresh server with `sig`
    (SIGSTOP or SIGKILL) once `streams` long streams are under way; notice_s bounds how long a
    SIGSTOP may leave /health at 200."""
    stop = sig == signal.SIGSTOP
    options = replace(options, extra_args=(*options.extra_args, *NO_RESTARTS))
    report = FaultReport(f"{sig.name} {target}", target, sig.name)
    rank = int(target.removeprefix("rank")) if target.startswith("rank") else None
    started = time.perf_counter()
    log_dir.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="fault-", dir=log_dir) as tmp,
        RuntimeServer(options, log_path=log_dir / f"{target}-{sig.name}.log", env={"TMPDIR": tmp}) as server,
    ):
        model = served_model(server.url)
        requests = [CompletionRequest(prompt_ids=(5 + i, 6, 7), max_tokens=STREAM_TOKENS, ignore_eos=True) for i in range(streams)]
        background = BackgroundStreams(server.url, model, requests, timeout_s=60).start()
        if not background.wait_streaming(min_tokens=2, timeout_s=60):
            report.lost.append("the streams never started")
        report.rss_mib = {label: round(size / 2**20, 1) for label, size in server.rss().items()}
        group = server.survivors()
        t0 = time.perf_counter()
        server.signal(target, sig)
        if stop:
            try:
                change = server.wait_health(lambda status: status != 200, timeout_s=notice_s)
                report.health_after_s, report.health_status = round(change.after_s, 2), change.status
            except TimeoutError as exc:
                report.lost.append(str(exc))
        try:
            results = background.join(timeout_s=30)
        except TimeoutError as exc:
            results = []
            report.lost.append(f"hung: {exc}")
        report.streams = len(requests)
        ends = [r.t_end for r in results if r.t_end is not None]
        report.streams_ended_s = round(max(ends) - t0, 2) if ends else None
        _judge(report, target, stop, rank, results)
        left = server.wait_gone(GONE_S)
        report.gone_s = None if left else round(time.perf_counter() - t0, 2)
        report.left = [ref.describe() for ref in left]
        report.ipc_dirs_left = sorted(p.name for p in Path(tmp).glob("tp-runtime-*"))
        port_error = bind_error(server.port) if not left else "processes still running"
        report.port = "free" if port_error is None else port_error
        if len(group) < 4:
            report.lost.append(f"only {len(group)} processes found before the fault")
    report.seconds = round(time.perf_counter() - started, 2)
    report.passed = not report.lost and not report.left and not report.ipc_dirs_left and report.port == "free"
    return report
