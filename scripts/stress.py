"""Stress: the adversarial cases of issue 12 against a live server while normal streams run, then
the faults that end a server, one fresh server each.

    python -m scripts.stress --short          # each case once beside 2 streams; 8 streams with
                                              # disconnects; 10 fuzzed requests; no frame fuzzer,
                                              # no faults (the tests run this)
    python -m scripts.stress                  # the long form: each case 3 times beside 16 streams,
                                              # a quarter of which hang up mid-stream; 64 streams
                                              # with disconnects; both fuzzers long; every fault
    python -m scripts.stress --json           # the whole report on stdout

It starts `tp-runtime serve` (TP=2, fp32, a short drain and body timeout) through the cluster
harness, takes every normal stream's greedy tokens alone as the reference, then runs each case
while the normal streams run beside it:

    top_k 2**31 and 2**64, top_p 1e-46, temperature 1e-40 and 1e300    -> 400 naming the field
    an 8 MB prompt, a 20 MB token-id list                              -> 413 (or 400), at once
    a lone surrogate in the prompt                                     -> 400
    a body that stops half-way, headers that trickle (slowloris)       -> 408 / closed within the timeout
    strangers on the frame socket (no key: garbage, forged frames, ...) -> counted and ignored, /health 200
    more requests than --max-num-queued-reqs at once                   -> 429 with Retry-After
    the HTTP fuzzer (scripts/harness/http_fuzz.py): the edge grid and  -> no 5xx, JSON errors, /health 200,
      --http-fuzz-examples random requests                                the same greedy text after
    --disconnect-streams streams at once, a random share hanging up    -> the rest complete with their
      (alone, not beside the normal streams)                              reference; nothing left running,
                                                                          waiting or holding a KV page
    SIGTERM with long streams running (last)                           -> each ends with an error event and
                                                                          [DONE]; every process exits

Then, with the server stopped:

    the keyed frame fuzzer (scripts/harness/frame_fuzz_run.py) against -> every frame its coded REJECT (or a
      two live executors of the same model: every wire case and          sound run); both ranks up; the good
      --frame-fuzz-examples mutated PREPAREs                              step's tokens unchanged; exit 0
    SIGSTOP of rank 1; kill -9 of the launcher, rank 0, rank 1, the    -> every stream ends with an error (an
      frontend; a fresh server each (scripts/harness/faults.py)           event and [DONE] where HTTP lives);
                                                                          /health 503; every pid gone, the ipc
                                                                          directory removed, the port free

A case passes when the server answered as it must, every normal stream beside it completed with
its reference tokens (a stream that hung up on purpose: with a prefix of them), and /health is 200
after it. The report (JSON: each case's expected and observed answer, its time, its normal streams;
RSS per process at the start and before the drain; the frame fuzzer's counts and its ranks' RSS;
each fault's losses, times and RSS) goes to --out/report.json and, with --json, to stdout; a
summary goes to stderr. Exit code 0 when every case passed, 1 when one did not, 2 when the server
did not start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:  # run as a file: the checkout's root makes `scripts` importable
    sys.path.insert(0, REPO_ROOT)

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed

from executor.model import default_model_path
from scripts.harness import http_fuzz
from scripts.harness.attacks import (
    Answer,
    incomplete_body,
    post_json,
    post_json_bytes,
    slow_headers,
)
from scripts.harness.client import (
    BackgroundStreams,
    CompletionRequest,
    StreamResult,
    served_model,
    stream_completion,
)
from scripts.harness.faults import run_fault
from scripts.harness.frame_fuzz_run import fuzz_frames
from scripts.harness.metrics import (
    M_CACHED,
    M_FRAME_CONNECTIONS,
    M_FRAME_RANK_DISCONNECTS,
    M_FRAME_UNAUTHENTICATED,
    M_FRAME_UNBOUND_DISCONNECTS,
    M_RUNNING,
    M_USED,
    M_WAITING,
)
from scripts.harness.output import default_out_dir, write_json
from scripts.harness.processes import bind_error
from scripts.harness.runtime import (
    FRONTEND,
    LAUNCHER,
    RuntimeServer,
    ServerOptions,
    ServerStartError,
    exit_on_sigterm,
)
from scripts.harness.strangers import KINDS, StrangerAct, Strangers
from tp_runtime.step_loop import EngineTimeouts

COMPLETIONS = "/v1/completions"
BODY_TIMEOUT_S = 2.0
HEADER_TIMEOUT_S = 2.0  # below the short form's --header-wait-s
DRAIN_S = 2.0
DRAIN_TOKENS = 1500  # far more than a drain of DRAIN_S lets a stream make
MANY_STREAMS = "streams with random disconnects"
FAULTS = ((signal.SIGSTOP, "rank1"), *((signal.SIGKILL, target) for target in (LAUNCHER, "rank0", "rank1", FRONTEND)))


@dataclass(frozen=True)
class Verdict:
    passed: bool
    observed: str


@dataclass
class NormalStreams:
    streams: int = 0
    correct: int = 0
    cancelled: int = 0  # hung up on purpose, with a prefix of the reference
    failures: list[str] = field(default_factory=list)


@dataclass
class CaseReport:
    name: str
    expected: str
    observed: str
    answered_as_expected: bool
    seconds: float
    health_after: int | None  # None after the drain: nothing may answer any more
    normal: NormalStreams
    passed: bool = False


@dataclass(frozen=True)
class Case:
    name: str
    expected: str
    attack: Callable[[Target], Verdict]


@dataclass
class Target:
    server: RuntimeServer
    model: str
    args: argparse.Namespace
    prompts: list[tuple[int, ...]]
    reference: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    @property
    def url(self) -> str:
        return self.server.url

    def body(self, **fields: object) -> dict[str, object]:
        return {"model": self.model, "prompt": "hello", "max_tokens": 4, **fields}


# ---- the cases ----------------------------------------------------------------------------------


def refused(answer: Answer, statuses: Sequence[int], field_name: str | None = None) -> Verdict:
    ok = answer.status in statuses and answer.json_error and (field_name is None or field_name in answer.message)
    return Verdict(bool(ok), answer.describe())


def field_case(name: str, field_name: str, value: object) -> Case:
    return Case(
        name,
        f"400 naming {field_name}",
        lambda t: refused(post_json(t.url, COMPLETIONS, t.body(**{field_name: value})), (400,), field_name),
    )


def big_prompt(t: Target) -> Verdict:
    answer = post_json(t.url, COMPLETIONS, t.body(prompt="a" * 8_000_000))
    return refused(answer, (400, 413))


def big_token_list(t: Target) -> Verdict:
    ids = b",".join([b"1"] * 10_000_000)  # 20 MB of JSON
    body = b'{"model": %s, "max_tokens": 4, "prompt": [%s]}' % (json.dumps(t.model).encode(), ids)
    return refused(post_json_bytes(t.url, COMPLETIONS, body), (400, 413))


def lone_surrogate(encoded: bytes) -> Callable[[Target], Verdict]:
    def attack(t: Target) -> Verdict:
        body = b'{"model": %s, "max_tokens": 4, "prompt": "%s alone"}' % (json.dumps(t.model).encode(), encoded)
        return refused(post_json_bytes(t.url, COMPLETIONS, body), (400,))

    return attack


def chat_surrogate(t: Target) -> Verdict:
    body = {"model": t.model, "max_tokens": 4, "messages": [{"role": "user", "content": "\ud800 alone"}]}
    return refused(post_json(t.url, "/v1/chat/completions", body), (400,))


def half_body(t: Target) -> Verdict:
    answer = incomplete_body(t.url, COMPLETIONS, declared=1000, sent=b'{"prompt": "', wait_s=BODY_TIMEOUT_S + 10)
    in_time = answer.seconds < BODY_TIMEOUT_S + 3
    return Verdict(answer.status == 408 and answer.json_error and in_time, answer.describe())


def trickled_headers(t: Target) -> Verdict:
    answer = slow_headers(t.url, COMPLETIONS, wait_s=t.args.header_wait_s)
    return Verdict(not answer.message.startswith("held open"), answer.describe())


def strangers(t: Target) -> Verdict:
    before = t.server.metrics() or {}
    knock = Strangers(t.server.frame_address())
    for i, kind in enumerate(KINDS):
        for identity in (None, b"rank-1", b"rank-00"):
            knock.perform(StrangerAct(kind, 500 if kind == "flood" else 4, identity, seed=i))
    want = knock.total
    deadline = time.monotonic() + 10
    while True:
        after = t.server.metrics() or {}
        grown = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in (
            M_FRAME_CONNECTIONS, M_FRAME_UNBOUND_DISCONNECTS, M_FRAME_UNAUTHENTICATED, M_FRAME_RANK_DISCONNECTS)}  # fmt: skip
        counted = (
            grown[M_FRAME_CONNECTIONS] == grown[M_FRAME_UNBOUND_DISCONNECTS] == want.connections
            and grown[M_FRAME_UNAUTHENTICATED] == want.unauthenticated_frames
            and grown[M_FRAME_RANK_DISCONNECTS] == 0
        )
        if counted or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    observed = (
        f"{knock.acts} acts: {grown[M_FRAME_CONNECTIONS]:g} connections, {grown[M_FRAME_UNAUTHENTICATED]:g} "
        f"unauthenticated frames counted (sent {want.connections}, {want.unauthenticated_frames}); "
        f"rank disconnects {grown[M_FRAME_RANK_DISCONNECTS]:g}; /health {t.server.health()}"
    )
    return Verdict(counted and t.server.health() == 200, observed)


def queue_overflow(t: Target) -> Verdict:
    """More requests at once than the bound on requests in flight (the normal streams count too)."""
    flood = 2 * t.args.max_queued

    async def go() -> list[httpx.Response | BaseException]:
        limits = httpx.Limits(max_connections=flood + 4)
        async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
            body = t.body(max_tokens=8, ignore_eos=True)
            return await asyncio.gather(*(client.post(f"{t.url}{COMPLETIONS}", json=body) for _ in range(flood)), return_exceptions=True)

    answers = asyncio.run(go())
    statuses = [a.status_code if isinstance(a, httpx.Response) else None for a in answers]
    limited = [a for a in answers if isinstance(a, httpx.Response) and a.status_code == 429]
    with_retry = [a for a in limited if a.headers.get("retry-after", "").isdigit() and "error" in a.json()]
    counts = {str(s): statuses.count(s) for s in sorted(set(statuses), key=str)}
    ok = bool(limited) and len(with_retry) == len(limited) and set(statuses) <= {200, 429}
    return Verdict(ok, f"{flood} at once (bound {t.args.max_queued}): {counts}; Retry-After on {len(with_retry)} of {len(limited)} 429s")


def fuzzed_requests(t: Target) -> Verdict:
    """The HTTP fuzzer's requests (every wire field at every edge in the long form, then
    `--http-fuzz-examples` random ones): no 5xx, JSON errors, well-formed streams, and the same
    greedy text after them as before."""
    statuses: dict[str, int] = {}
    failures: list[str] = []

    def check(http: httpx.Client, case: http_fuzz.Case) -> None:
        try:
            response = http_fuzz.send(http, case)
            statuses[str(response.status_code)] = statuses.get(str(response.status_code), 0) + 1
            http_fuzz.check_answer(case, response)
        except (AssertionError, httpx.HTTPError, ValueError, KeyError) as exc:
            failures.append(f"{type(exc).__name__}: {str(exc)[:200]}")

    with httpx.Client(base_url=t.url, timeout=120) as http:
        before = http_fuzz.greedy_text(http)
        grid = http_fuzz.edge_grid() if t.args.http_edge_grid else []
        for case in grid:
            check(http, case)

        @hypothesis_seed(t.rng.randrange(2**32))  # from --seed, another each round
        @settings(max_examples=t.args.http_fuzz_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=http_fuzz.CASES)
        def one(case: http_fuzz.Case) -> None:
            check(http, case)

        one()
        health = t.server.health()
        after = http_fuzz.greedy_text(http)
    sent = sum(statuses.values()) + len(failures)
    observed = (
        f"{sent} requests ({len(grid)} edge grid + {sent - len(grid)} random): statuses {dict(sorted(statuses.items()))}; "
        f"{len(failures)} failed checks{': ' + failures[0] if failures else ''}; /health {health}; greedy text "
        + ("unchanged" if after == before else f"changed: {before!r} -> {after!r}")
    )
    ok = not failures and health == 200 and after == before and sent > len(grid)
    return Verdict(ok, observed)


CASES = (
    field_case("top_k 2**31", "top_k", 2**31),
    field_case("top_k 2**64", "top_k", 2**64),
    field_case("top_p 1e-46", "top_p", 1e-46),
    field_case("temperature 1e-40", "temperature", 1e-40),
    field_case("temperature 1e300", "temperature", 1e300),
    Case("prompt of 8 MB", "413 or 400, JSON", big_prompt),
    Case("token list of 20 MB", "413 or 400, JSON", big_token_list),
    Case("lone surrogate, escaped", "400, JSON", lone_surrogate(b"\\ud800")),
    Case("lone surrogate, UTF-8 bytes", "400, JSON", lone_surrogate(b"\xed\xa0\x80")),
    Case("lone surrogate in a chat message", "400, JSON", chat_surrogate),
    Case("incomplete body", f"408 within {BODY_TIMEOUT_S:g} s + 3 s", half_body),
    Case("slowloris headers", "the connection closed, not held", trickled_headers),
    Case("strangers on the frame socket", "counted, ignored, /health 200", strangers),
    Case("queue overflow", "429 with Retry-After, the rest 200", queue_overflow),
    Case("HTTP fuzzer", "no 5xx, JSON errors, /health 200, greedy text unchanged", fuzzed_requests),
)


# ---- normal streams -----------------------------------------------------------------------------


def normal_requests(t: Target) -> list[CompletionRequest]:
    requests = []
    for i, prompt in enumerate(t.prompts):
        hang_up = t.args.cancel_every and i % t.args.cancel_every == t.args.cancel_every - 1
        requests.append(CompletionRequest(
            prompt_ids=prompt, max_tokens=t.args.normal_tokens, ignore_eos=True,
            cancel_after_tokens=t.rng.randint(1, t.args.normal_tokens - 1) if hang_up else None,
        ))  # fmt: skip
    return requests


def take_reference(t: Target) -> None:
    async def go() -> None:
        async with httpx.AsyncClient(timeout=None) as client:
            for prompt in t.prompts:
                request = CompletionRequest(prompt_ids=prompt, max_tokens=t.args.normal_tokens, ignore_eos=True)
                result = await stream_completion(client, t.url, t.model, request, 120.0)
                if not result.completed:
                    raise RuntimeError(f"the reference stream of {prompt} failed: {result.error}")
                t.reference[prompt] = result.token_ids

    asyncio.run(go())


def judge_normal(t: Target, requests: Sequence[CompletionRequest], results: Sequence[StreamResult]) -> NormalStreams:
    outcome = NormalStreams(streams=len(results))
    for request, result in zip(requests, results):
        want = t.reference[request.prompt_ids]
        clean = result.done_markers <= 1 and result.after_finish == 0 and len(result.response_ids) <= 1
        if result.cancelled and result.error is None and result.token_ids == want[: len(result.token_ids)] and clean:
            outcome.cancelled += 1
        elif result.completed and result.token_ids == want and result.done_markers == 1 and clean:
            outcome.correct += 1
        else:
            first = next((i for i, (a, b) in enumerate(zip(result.token_ids, want)) if a != b), None)
            outcome.failures.append(
                f"{request.prompt_ids}: {result.finish_reason or result.error} after {len(result.token_ids)} tokens"
                + (f", differs at {first}" if first is not None else "")
            )
    return outcome


def run_case(t: Target, case: Case) -> CaseReport:
    requests = normal_requests(t)
    streams = BackgroundStreams(t.url, t.model, requests, timeout_s=300).start()
    streams.wait_streaming(min_tokens=1, timeout_s=60)
    started = time.perf_counter()
    try:
        verdict = case.attack(t)
    except Exception as exc:  # noqa: BLE001 - a case that crashes the client is reported, not fatal
        verdict = Verdict(False, f"the case failed on the client: {type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - started
    results = streams.join()
    health = t.server.health()
    normal = judge_normal(t, requests, results)
    passed = verdict.passed and not normal.failures and health == 200
    return CaseReport(case.name, case.expected, verdict.observed, verdict.passed, seconds, health, normal, passed)


@dataclass(frozen=True)
class Settled:
    running: float | None
    waiting: float | None
    request_pages: float | None  # pages out of the free pool that no prefix snapshot holds
    seconds: float

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.request_pages == 0


def wait_settled(t: Target, timeout_s: float = 15.0) -> Settled:
    """Polls /metrics until no request runs or waits and no request holds a KV page."""
    started = time.monotonic()
    while True:
        values = t.server.metrics() or {}
        used, cached = values.get(M_USED), values.get(M_CACHED)
        settled = Settled(values.get(M_RUNNING), values.get(M_WAITING), None if used is None or cached is None else used - cached,
                          round(time.monotonic() - started, 2))  # fmt: skip
        if settled.idle or time.monotonic() - started > timeout_s:
            return settled
        time.sleep(0.2)


def many_streams(t: Target) -> CaseReport:
    """--disconnect-streams streams at once, a random share of which hang up mid-stream: the rest
    complete with their reference tokens, and afterwards nothing runs, waits or holds a page."""
    requests = []
    for i in range(t.args.disconnect_streams):
        hang_up = t.rng.random() < t.args.disconnect_share
        by_tokens = t.rng.random() < 0.5  # else after a time: queued, or mid-stream
        requests.append(CompletionRequest(
            prompt_ids=t.prompts[i % len(t.prompts)], max_tokens=t.args.normal_tokens, ignore_eos=True,
            cancel_after_tokens=t.rng.randint(1, t.args.normal_tokens // 2) if hang_up and by_tokens else None,
            cancel_after_s=round(t.rng.uniform(0.05, 1.0), 2) if hang_up and not by_tokens else None,
        ))  # fmt: skip
    started = time.perf_counter()
    results = BackgroundStreams(t.url, t.model, requests, timeout_s=300).start().join()
    seconds = time.perf_counter() - started
    normal = judge_normal(t, requests, results)
    settled = wait_settled(t)
    health = t.server.health()
    planned = sum(r.cancel_after_tokens is not None or r.cancel_after_s is not None for r in requests)
    observed = (
        f"{len(requests)} at once, {planned} set to hang up, {normal.cancelled} did (with a prefix of the reference; the "
        f"others ended first); {normal.correct} complete with their reference, {len(normal.failures)} wrong; all ended in {seconds:.1f} s; then "
        f"running {settled.running:g}, waiting {settled.waiting:g}, pages held by requests {settled.request_pages:g} "
        f"(after {settled.seconds:g} s)"
    ) if settled.running is not None and settled.request_pages is not None else f"no /metrics after the streams ({settled})"  # fmt: skip
    ok = settled.idle and normal.cancelled <= planned and normal.correct + normal.cancelled == len(requests)
    return CaseReport(MANY_STREAMS, "the rest complete with their reference; nothing left running or holding pages",
                      observed, ok, seconds, health, normal, ok and not normal.failures and health == 200)  # fmt: skip


def sigterm_drain(t: Target) -> CaseReport:
    """Last: long streams, then SIGTERM to the launcher. Each stream must end with the drain's
    error event and [DONE], and every process must exit on its own before the stop's margin."""
    requests = [CompletionRequest(prompt_ids=p, max_tokens=DRAIN_TOKENS, ignore_eos=True) for p in t.prompts]
    streams = BackgroundStreams(t.url, t.model, requests, timeout_s=120).start()
    streams.wait_streaming(min_tokens=2, timeout_s=60)
    started = time.perf_counter()
    t.server.signal(LAUNCHER, signal.SIGTERM)
    results = streams.join()
    left = t.server.wait_gone(DRAIN_S + 20)
    seconds = time.perf_counter() - started
    normal = NormalStreams(streams=len(results))
    for request, result in zip(requests, results):
        want = t.reference[request.prompt_ids]
        cut = result.error is not None and "shutting down" in result.error and result.done_markers == 1
        if cut and result.token_ids[: len(want)] == want[: len(result.token_ids)]:
            normal.correct += 1
        else:
            normal.failures.append(f"{request.prompt_ids}: {result.error or result.finish_reason}, [DONE] x{result.done_markers}")
    code = t.server.process.wait(timeout=10) if t.server.process is not None and not left else None
    port = bind_error(t.server.port) if not left else "processes still running"
    ends = [r.t_end - started for r in results if r.t_end is not None]
    observed = (
        f"streams cut {min(ends, default=0):.1f}-{max(ends, default=0):.1f} s after SIGTERM; launcher exit code {code}; "
        f"{len(left)} processes left; port {'free' if port is None else port}"
    )
    ok = not left and code == 0 and port is None
    health = t.server.health()
    return CaseReport("SIGTERM drain", f"each stream: error event + [DONE] within {DRAIN_S:g} s; exit 0; nothing left",
                      observed, ok, seconds, health, normal, ok and not normal.failures and health is None)  # fmt: skip


# ---- the run ------------------------------------------------------------------------------------


def server_options(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(
        tensor_parallel_size=args.tp, model=args.model, dtype="fp32", num_kv_pages=args.num_kv_pages,
        max_model_len=2048, max_num_seqs=max(8, args.normal_streams), max_num_batched_tokens=512,
        extra_args=(
            "--max-num-queued-reqs", str(args.max_queued), "--request-body-timeout", str(BODY_TIMEOUT_S), "--request-header-timeout", str(HEADER_TIMEOUT_S),
            "--shutdown-timeout", str(DRAIN_S),
        ),
    )  # fmt: skip


def run(args: argparse.Namespace, out: Path) -> dict[str, object]:
    options = server_options(args)
    server = RuntimeServer(options, log_path=out / "server.log")
    server.start()
    try:
        prompts = [tuple(range(11 + 7 * i, 15 + 7 * i)) for i in range(args.normal_streams)]
        t = Target(server, served_model(server.url), args, prompts, rng=random.Random(args.seed))
        take_reference(t)
        rss_start = server.rss()
        reports = [run_case(t, case) for _ in range(args.repeat) for case in CASES]
        reports.append(many_streams(t))
        rss_before_drain = server.rss()
        reports.append(sigterm_drain(t))
    finally:
        server.stop()
    frames = fuzz_frames(args.model or default_model_path(), args.frame_fuzz_examples, out / "frame-fuzz", args.seed) if args.frame_fuzz_examples else None
    notice_s = EngineTimeouts().peer_silence_s + 1.5  # as tests/e2e/test_sigstop.py allows a busy machine
    faults = [run_fault(options, target, sig, out / "faults", notice_s=notice_s) for sig, target in FAULTS] if args.faults else []
    return {
        "passed": all(r.passed for r in reports) and (frames is None or frames.passed) and all(f.passed for f in faults),
        "server_argv": options.argv(server.port),
        "normal_streams_per_case": args.normal_streams,
        "normal_tokens": args.normal_tokens,
        "repeat": args.repeat,
        "disconnect_streams": args.disconnect_streams,
        "http_fuzz_examples": args.http_fuzz_examples,
        "http_edge_grid": args.http_edge_grid,
        "frame_fuzz_examples": args.frame_fuzz_examples,
        "rss_mib": {
            "start": {k: round(v / 2**20, 1) for k, v in rss_start.items()},
            "before_drain": {k: round(v / 2**20, 1) for k, v in rss_before_drain.items()},
        },
        "cases": [asdict(r) for r in reports],
        "frame_fuzz": None if frames is None else asdict(frames),
        "faults": [asdict(f) for f in faults],
    }


def print_summary(report: dict[str, object]) -> None:
    lines = []
    for case in report["cases"]:  # type: ignore[union-attr]
        normal = case["normal"]
        mark = "ok  " if case["passed"] else "MISS"
        lines.append(
            f"[{mark}] {case['name']:<30} {case['observed'][:110]}\n"
            f"       normal streams: {normal['correct']} correct, {normal['cancelled']} hung up, "
            f"{len(normal['failures'])} wrong of {normal['streams']}; /health after: {case['health_after']}"
        )
    frames = report["frame_fuzz"]
    if frames is not None:
        mark = "ok  " if frames["passed"] else "MISS"
        lines.append(
            f"[{mark}] frame fuzzer (keyed, live executors) {frames['wire_cases']} wire cases, {frames['mutations']} mutated "
            f"PREPAREs: answers {frames['answers']}; {len(frames['failures'])} failures; good step "
            f"{frames['good_tokens_before']} -> {frames['good_tokens_after']}; exit codes {frames['exit_codes']}; {frames['seconds']:.0f} s"
        )
    for fault in report["faults"]:  # type: ignore[union-attr]
        mark = "ok  " if fault["passed"] else "MISS"
        lines.append(
            f"[{mark}] {fault['name']:<30} {fault['ended_with_error']} of {fault['streams']} streams ended with an error, "
            f"lost {fault['lost'] or 'nothing'}; /health left 200 after {fault['health_after_s']} s; streams ended "
            f"{fault['streams_ended_s']} s, every process gone {fault['gone_s']} s after the signal; left {fault['left'] or 'none'}; "
            f"ipc dirs left {fault['ipc_dirs_left'] or 'none'}; port {fault['port']}"
        )
    lines.append(f"RSS MiB at start {report['rss_mib']['start']}, before the drain {report['rss_mib']['before_drain']}")  # type: ignore[index]
    lines.append("stress: PASSED" if report["passed"] else "stress: FAILED")
    sys.stderr.write("\n".join(lines) + "\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="each case once beside 2 short streams")
    p.add_argument("--model", default=None, help="default: the runtime's default model")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--num-kv-pages", type=int, default=512)
    p.add_argument("--normal-streams", type=int, default=None, help="streams beside each case (short 2, long 16)")
    p.add_argument("--normal-tokens", type=int, default=None, help="tokens of each (short 12, long 48)")
    p.add_argument("--repeat", type=int, default=None, help="rounds of the cases (short 1, long 3)")
    p.add_argument("--cancel-every", type=int, default=None, help="every Nth normal stream hangs up (short 0: none, long 4)")
    p.add_argument("--header-wait-s", type=float, default=None, help="how long a slowloris may be held (short 5, long 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="report directory (default reports/stress-<time>)")
    p.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    p.add_argument("--disconnect-streams", type=int, default=None, help="streams at once in the disconnect case (short 8, long 64)")
    p.add_argument("--disconnect-share", type=float, default=0.3, help="the chance that each of them hangs up mid-stream")
    p.add_argument("--http-fuzz-examples", type=int, default=None, help="random requests of the HTTP fuzzer (short 10, long 300)")
    p.add_argument("--http-edge-grid", action=argparse.BooleanOptionalAction, default=None,
                   help="also every wire field at every edge, 988 requests (short no, long yes)")  # fmt: skip
    p.add_argument("--frame-fuzz-examples", type=int, default=None, help="mutated PREPAREs against live executors (short 0: skipped, long 300)")
    p.add_argument("--faults", action=argparse.BooleanOptionalAction, default=None,
                   help="SIGSTOP of rank 1, kill -9 of each process, a fresh server each (short no, long yes)")  # fmt: skip
    args = p.parse_args(argv)
    short = {"normal_streams": 2, "normal_tokens": 12, "repeat": 1, "cancel_every": 0, "header_wait_s": 5.0, "disconnect_streams": 8,
             "http_fuzz_examples": 10, "http_edge_grid": False, "frame_fuzz_examples": 0, "faults": False}  # fmt: skip
    long = {"normal_streams": 16, "normal_tokens": 48, "repeat": 3, "cancel_every": 4, "header_wait_s": 30.0, "disconnect_streams": 64,
            "http_fuzz_examples": 300, "http_edge_grid": True, "frame_fuzz_examples": 300, "faults": True}  # fmt: skip
    for name, value in (short if args.short else long).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.normal_streams < 1 or args.normal_tokens < 2 or args.repeat < 1 or args.disconnect_streams < 1 or args.http_fuzz_examples < 1:
        p.error("--normal-streams, --repeat, --disconnect-streams and --http-fuzz-examples must be at least 1, --normal-tokens at least 2")
    if not 0.0 <= args.disconnect_share <= 1.0 or args.frame_fuzz_examples < 0:
        p.error("--disconnect-share must be within [0, 1], --frame-fuzz-examples at least 0")
    args.max_queued = max(args.normal_streams, args.disconnect_streams) + 8
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    out = args.out or default_out_dir("stress")
    try:
        report = run(args, out)
    except ServerStartError as exc:
        sys.stderr.write(f"stress: error: {exc}\n")
        return 2
    write_json(out / "report.json", report)
    print_summary(report)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
