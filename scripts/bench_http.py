"""The HTTP thread's own CPU per streamed token, with no model beside it.

    python scripts/bench_http.py                              # concurrency 1 and 8, a 15 ms step
    python scripts/bench_http.py --concurrency 8 --step-ms 5 --tokens 200 --calls --json
    python scripts/bench_http.py --route completions

The frontend's real app (tp_runtime.http.create_app) under the uvicorn server the frontend runs
(tp_runtime.http.server), on the real Engine against tests/server/fake_rank.py's rank 0, which
answers every step after --step-ms with one token (" word") per row. Clients in threads of their
own stream OpenAI requests over real sockets and read every chunk. Reported per level, from each
thread's own CPU clock over the window in which the clients stream: the HTTP thread's and the
engine thread's CPU per output token, and with --calls (a second pass, counted with
sys.setprofile in the HTTP thread) the HTTP thread's Python and C calls per token, which no noise
on a shared machine moves. Served beside a model the same code runs with cold caches and costs
several times more (docs/control_plane.md): this measures the count of work, bench_serving.py
its price.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_engine import CallCounter, add_fake_rank_options, check_fake_rank_options  # noqa: E402
from tests.server.fake_rank import running_engine  # noqa: E402
from tp_runtime.http import ServerSettings, create_app  # noqa: E402
from tp_runtime.http.server import http_server  # noqa: E402
from executor.default_model import default_model_path  # noqa: E402
from tp_runtime.tokenizer import Tokenizer  # noqa: E402

ROUTES = {
    "chat": ("/v1/chat/completions", lambda tokens: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}),
    "completions": ("/v1/completions", lambda tokens: {"prompt": "tell me", "max_tokens": tokens}),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(port: int, path: str, body: dict) -> int:
    """One streamed request read to its end; the completion tokens its usage chunk counts."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{path} answered {response.status}: {response.read()[:200]!r}")
        usage = None
        for line in response:
            if line.startswith(b"data: {") and b'"usage":{' in line:
                usage = json.loads(line[6:])["usage"]
        if usage is None:
            raise RuntimeError("the stream ended without its usage chunk")
        return usage["completion_tokens"]
    finally:
        connection.close()


def measure(
    concurrency: int, tokens: int, step_ms: float, route: str, count_calls: bool, forwards: int = 1
) -> dict[str, float]:
    tokenizer = Tokenizer.from_model_path(default_model_path())
    word = tokenizer.encode(" word")[0]
    path, make_body = ROUTES[route]
    body = {**make_body(tokens), "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    counter = CallCounter()
    with running_engine(
        token=word, step_delay_s=step_ms / 1000, max_inflight_steps=2, num_scheduler_steps=forwards
    ) as engine:
        app = create_app(engine, tokenizer, ServerSettings(("fake",)))
        port = _free_port()
        server = http_server(app, "127.0.0.1", port, "warning", 5, 10.0)

        def serve() -> None:
            if count_calls:
                sys.setprofile(counter)
            server.run()

        thread = threading.Thread(target=serve, name="http", daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 20
            while not server.started:
                if time.monotonic() > deadline or not thread.is_alive():
                    raise RuntimeError("uvicorn did not start")
                time.sleep(0.01)
            _stream(port, path, {**body, "max_tokens": 8})  # warm: imports, first request's set-up
            http_clock = time.pthread_getcpuclockid(thread.ident)
            engine_clock = time.pthread_getcpuclockid(engine._thread.ident)
            counts = [0] * concurrency

            def client(i: int) -> None:
                counts[i] = _stream(port, path, body)

            clients = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
            calls0 = counter.calls
            http0, engine0, wall0 = time.clock_gettime(http_clock), time.clock_gettime(engine_clock), time.perf_counter()
            for c in clients:
                c.start()
            for c in clients:
                c.join()
            http_cpu = time.clock_gettime(http_clock) - http0
            engine_cpu = time.clock_gettime(engine_clock) - engine0
            wall = time.perf_counter() - wall0
            calls = counter.calls - calls0
        finally:
            server.stop()
            thread.join(timeout=10)
    total = sum(counts)
    if count_calls:
        return {"concurrency": concurrency, "http_calls_per_token": round(calls / total)}
    return {
        "concurrency": concurrency,
        "tokens": total,
        "http_cpu_us_per_token": round(http_cpu / total * 1e6, 1),
        "engine_cpu_us_per_token": round(engine_cpu / total * 1e6, 1),
        "tokens_per_s": round(total / wall, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_fake_rank_options(p)
    p.add_argument("--route", choices=sorted(ROUTES), default="chat")
    p.add_argument("--calls", action="store_true", help="also count the HTTP thread's calls per token")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    check_fake_rank_options(p, args)
    forwards = args.num_scheduler_steps
    levels = [measure(c, args.tokens, args.step_ms, args.route, False, forwards) for c in args.concurrency]
    if args.calls:
        for level in levels:
            level.update(measure(level["concurrency"], args.tokens, args.step_ms, args.route, True, forwards))
    report = {
        "route": args.route, "step_ms": args.step_ms, "tokens_per_stream": args.tokens, "num_scheduler_steps": forwards,
        "levels": levels,
    }
    if args.json:
        print(json.dumps(report))
        return
    for level in levels:
        calls = f", {level['http_calls_per_token']} calls" if "http_calls_per_token" in level else ""
        print(
            f"c={level['concurrency']:<3} HTTP thread {level['http_cpu_us_per_token']:7.1f} us/token{calls}, "
            f"engine thread {level['engine_cpu_us_per_token']:7.1f} us/token, {level['tokens_per_s']} tok/s"
        )


if __name__ == "__main__":
    main()
