"""Interference benchmark: how long running streams stall when a long prompt arrives, per server
flag variant (the token budget above all).

    python scripts/bench_interference.py                      # --max-num-batched-tokens 512 against 2048
    python scripts/bench_interference.py --rounds 2 --json
    python scripts/bench_interference.py --variant "small=--max-num-batched-tokens 256" --variant "default="

Each variant is one `tp-runtime serve` of the default model (greedy, --max-num-seqs 32). A round:
--streams streams decode (64-token prompts, --stream-tokens tokens each, ignore_eos); --arrive-s
after they started one prompt of --long-tokens tokens arrives (one output token). Reported per
variant and round:

    stream_longest_gap_s   the longest time between two pieces of one stream, median over the streams:
                           the stall the long prompt's prefill put in every stream
    gap_p99_s              the 99th percentile of every gap between two pieces
    long_ttft_s            the long prompt's own time to first token

A warm-up round with a short "long" prompt runs first on each server. The variants run one after
the other, alternating their order each round. Exit code 0 when every request completed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:  # run as a file: the checkout's root makes `scripts` importable
    sys.path.insert(0, REPO_ROOT)

import httpx  # noqa: E402

from scripts.harness.client import CompletionRequest, StreamResult, served_model, stream_completion  # noqa: E402
from scripts.harness.output import default_out_dir  # noqa: E402
from scripts.harness.runtime import RuntimeServer, ServerOptions, exit_on_sigterm  # noqa: E402

STREAM_PROMPT_TOKENS = 64
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Round:
    variant: str
    round: int
    stream_longest_gap_s: float
    gap_p99_s: float
    long_ttft_s: float
    failed: tuple[str, ...] = ()


def summarize(variant: str, index: int, streams: Sequence[StreamResult], long: StreamResult) -> Round:
    failed = tuple(r.error or "incomplete" for r in (*streams, long) if not r.completed)
    gaps = [r.itl_s for r in streams]
    longest = [max(g) for g in gaps if g]
    every = sorted(gap for g in gaps for gap in g)
    return Round(
        variant=variant,
        round=index,
        stream_longest_gap_s=round(statistics.median(longest), 4) if longest else float("nan"),
        gap_p99_s=round(every[min(len(every) - 1, int(0.99 * len(every)))], 4) if every else float("nan"),
        long_ttft_s=round(long.ttft_s, 4) if long.ttft_s is not None else float("nan"),
        failed=failed,
    )


async def one_round(
    url: str, model: str, args: argparse.Namespace, long_tokens: int, seed: int
) -> tuple[list[StreamResult], StreamResult]:
    rng = random.Random(seed)

    def prompt(length: int) -> tuple[int, ...]:
        return tuple(rng.randrange(100, 40000) for _ in range(length))

    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        streams = [
            asyncio.ensure_future(stream_completion(
                client, url, model, CompletionRequest(prompt(STREAM_PROMPT_TOKENS), args.stream_tokens, ignore_eos=True),
                TIMEOUT_S,
            ))
            for _ in range(args.streams)
        ]  # fmt: skip
        await asyncio.sleep(args.arrive_s)
        long_request = CompletionRequest(prompt(long_tokens), 1, ignore_eos=True)
        long = await stream_completion(client, url, model, long_request, TIMEOUT_S)
        return list(await asyncio.gather(*streams)), long


def variants_of(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    given = args.variant or ["budget512=--max-num-batched-tokens 512", "budget2048=--max-num-batched-tokens 2048"]
    out: dict[str, tuple[str, ...]] = {}
    for spec in given:
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"bench_interference: --variant takes NAME=FLAGS, got {spec!r}")
        out[name] = tuple(shlex.split(flags))
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_interference", description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", metavar="NAME=FLAGS", help="a server with these serve flags; repeatable")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=160)
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--arrive-s", type=float, default=3.0, help="when the long prompt arrives after the streams start")
    p.add_argument("--out", type=Path, default=None, help="server logs (default reports/interference-<time>)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if min(args.long_tokens, args.streams, args.stream_tokens, args.rounds) < 1:
        p.error("--long-tokens, --streams, --stream-tokens and --rounds take positive counts")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    out = args.out or default_out_dir("interference")
    variants = variants_of(args)
    rounds: list[Round] = []
    for index in range(args.rounds):
        order = list(variants) if index % 2 == 0 else list(reversed(variants))
        for name in order:
            options = ServerOptions(max_num_seqs=32, max_model_len=args.long_tokens + 64, extra_args=variants[name])
            with RuntimeServer(options, log_path=out / f"{name}-{index}.log") as server:
                model = served_model(server.url)
                asyncio.run(one_round(server.url, model, args, STREAM_PROMPT_TOKENS * 4, seed=index))  # warm-up
                streams, long = asyncio.run(one_round(server.url, model, args, args.long_tokens, seed=index))
            rounds.append(summarize(name, index, streams, long))
            if not args.json:
                r = rounds[-1]
                print(
                    f"{name:>14} round {index}: streams' longest gap {r.stream_longest_gap_s:7.3f} s, "
                    f"gap p99 {r.gap_p99_s:7.3f} s, long prompt TTFT {r.long_ttft_s:7.3f} s"
                    + (f", FAILED: {r.failed[0]}" if r.failed else ""),
                    flush=True,
                )
    if args.json:
        print(json.dumps([asdict(r) for r in rounds], indent=2))
    return 1 if any(r.failed for r in rounds) else 0


if __name__ == "__main__":
    sys.exit(main())
