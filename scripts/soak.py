"""Soak run: the runtime under KV pressure with fault injection, checked request by request.

    python scripts/soak.py                      # the short form: TP=2, ~2-3 minutes on a 2-core CPU
    python scripts/soak.py --requests 2000      # the long form a release is judged by
    python scripts/soak.py --skip-clears        # negative control: the checks must catch the damage
    python scripts/soak.py --kill-every 10      # fault mode: kill -9 of a rank every 10 requests

It starts `tp-runtime serve` at --tp ranks with a KV pool small enough that prefix snapshots are
evicted, requests are preempted (recomputed, and offloaded to host slots when --swap-space allows)
and pages are reused all the time, with the cache poisoned at allocation and every freed page
poisoned. It drives long and short prompts alternately, with shared system prompts, cancellations
mid-stream, and greedy and seeded sampled requests. Then it runs the greedy prompts again on a
TP=1 server without pressure or poison and checks (CHECKS in soak_checks.py); any miss exits
non-zero.

Its parts: soak_workload.py (the requests), soak_run.py (the servers, the stream, the monitor),
soak_checks.py (the verdicts) and soak_report.py (report.json, timeline.json, soak.png).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:  # run as a file: the checkout's root makes `scripts` importable
    sys.path.insert(0, REPO_ROOT)

from scripts.harness.output import default_out_dir  # noqa: E402
from scripts.harness.runtime import ServerStartError, exit_on_sigterm  # noqa: E402
from scripts.prompts import PromptBuilder  # noqa: E402
from scripts.soak_checks import Check, Comparison, SoakError, check_passed, check_run, compare_greedy, rss_verdict  # noqa: E402
from scripts.soak_report import build_report, print_summary, write_report  # noqa: E402
from scripts.soak_run import run_reference, run_under_test, soak_server_options  # noqa: E402
from scripts.soak_workload import RunRecord, WorkloadShape, build_request, max_request_tokens, outcome_of  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tp-runtime soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=None, help="requests in the stream (default 40, or unlimited with --duration)")
    p.add_argument("--duration", type=float, default=None, help="send requests for this many seconds instead")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the runtime under test")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--num-kv-pages", type=int, default=96, help="a pool small enough for pressure")
    p.add_argument("--max-model-len", type=int, default=1280)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--swap-space", default="6MiB", help="host offload buffer; 0 preempts by recompute only")
    p.add_argument("--skip-clears", action="store_true", help="negative control: the checks must detect the damage")
    p.add_argument(
        "--kill-every", type=int, default=0, metavar="K",
        help="fault mode: kill -9 of a rank (the last, then rank 0, in turn) after every K finished requests",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-fraction", type=float, default=0.25, help="share of requests before RSS must stay flat")
    p.add_argument("--rss-tolerance-mib", type=float, default=48.0)
    p.add_argument(
        "--deterministic", action=argparse.BooleanOptionalAction, default=True,
        help="both servers in the deterministic mode, and the reference pass compares greedy outputs exactly, with "
        "no near-tie class (default on; --no-deterministic judges differences by --near-tie-tolerance)",
    )
    p.add_argument(
        "--near-tie-tolerance", type=float, default=None,
        help="logits, with --no-deterministic; default 0.05 for fp32, 0.5 otherwise",
    )
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--poll-interval", type=float, default=0.5)
    p.add_argument("--long-tokens", type=int, nargs=2, default=(300, 900), metavar=("MIN", "MAX"))
    p.add_argument("--short-tokens", type=int, nargs=2, default=(20, 60), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, nargs=2, default=(16, 96), metavar=("MIN", "MAX"))
    p.add_argument("--out", type=Path, default=None, help="report directory (default reports/soak-<time>)")
    p.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    args = p.parse_args(argv)
    if args.requests is None and args.duration is None:
        args.requests = 40
    if args.deterministic:
        if args.near_tie_tolerance is not None:
            p.error("--near-tie-tolerance applies with --no-deterministic only: the deterministic reference is exact")
    elif args.near_tie_tolerance is None:
        args.near_tie_tolerance = 0.05 if args.dtype == "fp32" else 0.5
    if args.concurrency < 1 or args.tp < 1 or (args.requests is not None and args.requests < 1):
        p.error("--concurrency, --tp and --requests must be at least 1")
    if not 0.0 <= args.warmup_fraction < 1.0:
        p.error("--warmup-fraction must be in [0, 1)")
    return args

def main(argv: Sequence[str] | None = None) -> int:
    from executor.model import default_model_path
    from tp_runtime.config import parse_size
    from tp_runtime.tokenizer import Tokenizer

    args = parse_args(argv)
    exit_on_sigterm()
    out = args.out or default_out_dir("soak-control" if args.skip_clears else "soak")
    model = args.model or default_model_path()
    tokenizer = Tokenizer.from_model_path(model)
    builder = PromptBuilder(tokenizer)
    shape = WorkloadShape(
        long_tokens=tuple(args.long_tokens), short_tokens=tuple(args.short_tokens), max_tokens=tuple(args.max_tokens)
    )
    longest = max_request_tokens(builder, shape)
    if longest > args.max_model_len:
        raise SystemExit(f"soak: error: a request may need {longest} tokens but --max-model-len is {args.max_model_len}")
    make = lambda i: build_request(builder, i, args.seed, shape)  # noqa: E731
    fixed = [make(i) for i in range(args.requests)] if args.duration is None else None
    record = RunRecord(requests=list(fixed) if fixed is not None else [])

    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = os.getloadavg()
    options = soak_server_options(args)
    t_start = time.perf_counter()
    try:
        shutdown_code = run_under_test(options, fixed, make, args, record, out)
    except ServerStartError as exc:
        sys.stderr.write(f"soak: error: {exc}\n")
        return 2
    elapsed = max((res.t_end for res in record.results.values() if res.t_end is not None), default=record.t0) - record.t0

    swap_space = parse_size(args.swap_space) > 0
    rss = [rss_verdict(label, samples, record.warmup_end, args.rss_tolerance_mib) for label, samples in sorted(record.rss.items())]
    greedy_done = [r for r in record.requests if r.greedy and outcome_of(record.results[r.index]) == "completed" and record.results[r.index].token_ids]
    damage_seen = not check_passed(check_run(record, [], rss, swap_space=swap_space), "logits_finite")
    faults = len(record.faults) if args.kill_every else None
    comparisons: list[Comparison] = []
    reference_error: str | None = None
    if greedy_done and not (args.skip_clears and damage_seen):
        try:
            reference = run_reference(args, greedy_done, out)
            comparisons = compare_greedy(
                greedy_done,
                record.results,
                reference,
                eos=tokenizer.eos_token_ids[0],
                model=model,
                dtype=args.dtype,
                tolerance=args.near_tie_tolerance,
            )
        except (SoakError, ServerStartError) as exc:
            reference_error = str(exc)
    checks = check_run(record, comparisons, rss, swap_space=swap_space, faults=faults)
    if reference_error is not None:
        checks.append(Check("reference_run", False, f"the TP=1 reference run failed: {reference_error}"))

    report = build_report(
        args,
        model=model,
        server_argv=options.argv(0)[5:],
        max_request_tokens=longest,
        started_at=started,
        load_before=load_before,
        wall_s=time.perf_counter() - t_start,
        server_exit_code=shutdown_code,
        record=record,
        comparisons=comparisons,
        rss=rss,
        checks=checks,
        elapsed_s=elapsed,
    )
    write_report(report, record, out)
    print_summary(report, out)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
