"""The frontend side of `tp-runtime generate`: one request, its text to stdout as it comes."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tp_runtime.cli.options import build_parser


def run_generate_job(engine, tokenizer, argv: Sequence[str]) -> int:  # noqa: ANN001 (frontend types)
    """The frontend side of `generate`: one request, text to stdout as it comes."""
    from scheduler.request import SamplingParams
    from tp_runtime.chat import render_chat
    from tp_runtime.engine import EngineUnavailable
    from tp_runtime.tokenizer import IncrementalDetokenizer

    args = build_parser().parse_args(list(argv))
    try:
        engine.wait_ready()
    except EngineUnavailable as exc:
        sys.stderr.write(f"tp-runtime: error: {exc}\n")
        return 1
    if args.raw:
        ids = tokenizer.encode(args.prompt)
    else:  # the template writes BOS and the turn markers itself
        ids = tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": args.prompt}]), add_special_tokens=False)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_token_ids=tuple(tokenizer.eos_token_ids),
    )
    detok = IncrementalDetokenizer(tokenizer, ids)
    pieces: list[str] = []
    for event in engine.submit(ids, params):
        if event.error:
            sys.stdout.flush()
            sys.stderr.write(f"tp-runtime: generation failed: {event.error}\n")
            return 1
        for token in event.token_ids:
            delta = detok.add(token)
            pieces.append(delta)
            if args.stream:
                sys.stdout.write(delta)
                sys.stdout.flush()
    tail = detok.flush()
    pieces.append(tail)
    sys.stdout.write(tail if args.stream else "".join(pieces))
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0
