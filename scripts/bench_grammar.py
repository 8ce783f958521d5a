"""Grammar engines on this CPU: llguidance (what the runtime uses) against xgrammar, on the default
model's vocabulary (SmolLM2, 49,152 tokens).

For each grammar (a JSON schema with a nested object and an array, any JSON object, a regex, a
choice) it measures the compile time and, along one valid output tokenized as the model would write
it, the time to fill one row's token mask and to advance the matcher by one token: the work the
sampler adds per token of a constrained request. `sampler_overhead` times rank 0's sampling of a
step of 1, 8 and 32 rows with and without a JSON-schema grammar on every row (masks filled, unpacked
and applied, tokens consumed): the cost per token of structured output on the model's thread, as the
CPU time of that thread (one intra-op thread), so that a busy machine's waits are not counted. Each side runs in a subprocess of its own, in turn,
`--rounds` times, and the report gives medians.

    python scripts/bench_grammar.py [--rounds 3] [--xgrammar-path /tmp/xgr]

xgrammar is optional: where it cannot be imported (it is not a dependency; `pip install --target
/tmp/xgr --no-deps xgrammar apache-tvm-ffi` makes it importable from --xgrammar-path), only
llguidance is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "address", "tags"],
    "additionalProperties": False,
}
CASES = {
    "json_schema": (
        "json_schema",
        json.dumps(SCHEMA),
        '{"name": "Ada Lovelace", "age": 36, "address": {"city": "London", "zip": "12345"}, '
        '"tags": ["mathematician", "writer", "analyst"]}',
    ),
    "json_object": ("json_object", "", '{"answer": 4, "reason": "two plus two is four", "sure": true}'),
    "regex": ("regex", r"\d{3}-\d{3}-\d{4}", "555-123-4567"),
    "choice": ("choice", json.dumps(["positive", "negative", "neutral"]), "neutral"),
}


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def run_llguidance(tokenizer) -> dict:
    import llguidance
    import llguidance.numpy as lln

    started = time.perf_counter()
    lltok = llguidance.LLTokenizer(
        tokenizer.backend_json(), n_vocab=tokenizer.vocab_size, eos_token=list(tokenizer.eos_token_ids)
    )
    setup = time.perf_counter() - started
    grammars = {
        "json_schema": lambda text: llguidance.LLMatcher.grammar_from_json_schema(text),
        "json_object": lambda _text: llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}'),
        "regex": lambda text: llguidance.LLMatcher.grammar_from_regex(text),
        "choice": lambda text: llguidance.grammar_from("choice", text),
    }
    out = {"setup_ms": round(setup * 1e3, 1), "cases": {}}
    bitmask = lln.allocate_token_bitmask(1, tokenizer.vocab_size)
    for name, (kind, text, answer) in CASES.items():
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammars[kind](text))
        compile_s = time.perf_counter() - started
        assert not matcher.is_error(), matcher.get_error()
        out["cases"][name] = _walk(
            compile_s, tokenizer.encode(answer, add_special_tokens=False),
            lambda: lln.fill_next_token_bitmask(matcher, bitmask, 0), matcher.consume_token,
        )
    return out


def run_xgrammar(tokenizer) -> dict:
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo(
        [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)],
        vocab_type=xgr.VocabType.RAW,
        vocab_size=tokenizer.vocab_size,
        stop_token_ids=list(tokenizer.eos_token_ids),
    )
    compiler = xgr.GrammarCompiler(info)
    setup = time.perf_counter() - started
    compile_of = {
        "json_schema": compiler.compile_json_schema,
        "json_object": lambda _text: compiler.compile_builtin_json_grammar(),
        "regex": compiler.compile_regex,
        "choice": lambda text: compiler.compile_regex("|".join(json.loads(text))),
    }
    out = {"setup_ms": round(setup * 1e3, 1), "cases": {}}
    bitmask = xgr.allocate_token_bitmask(1, tokenizer.vocab_size)
    for name, (kind, text, answer) in CASES.items():
        started = time.perf_counter()
        matcher = xgr.GrammarMatcher(compile_of[kind](text))
        compile_s = time.perf_counter() - started
        out["cases"][name] = _walk(
            compile_s, tokenizer.encode(answer, add_special_tokens=False),
            lambda: matcher.fill_next_token_bitmask(bitmask, 0), matcher.accept_token,
        )
    return out


def run_sampler_overhead(tokenizer, rows: int, steps: int = 40) -> dict:
    """What a constrained row adds where rank 0 samples (executor/sampling_state.py and sampler.py):
    the masks filled, unpacked and applied, and the tokens consumed, against the same rows
    unconstrained; per step of `rows` rows, greedy, on SmolLM2-sized logits."""
    import numpy as np
    import torch

    from executor.grammar import GrammarEngine, GrammarVocabulary
    from executor.sampler import SamplingBatch, sample
    from executor.sampling_state import SamplingStates
    from protocol.frames import Prepare, plain_sampling
    from protocol.grammar import GrammarKind, GrammarSpec

    # One intra-op thread: on a shared 2-core machine two threads wait for each other at every
    # op (50 ms per op measured under a load of 8), which would time the neighbours, not the work.
    torch.set_num_threads(1)
    vocab = tokenizer.vocab_size
    engine = GrammarEngine(lambda: GrammarVocabulary(tokenizer.backend_json(), tuple(tokenizer.eos_token_ids)), vocab)
    spec = np.frombuffer(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)).encode(), dtype=np.uint8)
    answer = tokenizer.encode(CASES["json_schema"][2], add_special_tokens=False)

    def prepare(state: int, constrained: bool) -> Prepare:
        fields = plain_sampling(rows)
        if constrained:
            fields.update(
                sampling_state=np.full(rows, state, dtype=np.uint8),
                grammar_lens=np.full(rows, spec.shape[0] if state == 1 else 0, dtype=np.int32),
                grammar=np.tile(spec, rows) if state == 1 else np.zeros(0, dtype=np.uint8),
            )
        base = Prepare.greedy(np.ones(rows), np.ones(rows), np.zeros(rows), np.ones(rows), np.zeros(rows))
        return dataclasses.replace(base, **fields)

    out = {}
    for constrained in (False, True):
        states = SamplingStates(engine)
        first = prepare(1, constrained)
        states.prefetch(first)
        states.begin(first, {})
        held = prepare(2, constrained)
        times = []
        for step in range(min(steps, len(answer))):
            logits = torch.randn(rows, vocab)
            logits[:, answer[step]] += 50.0  # the valid answer, so the grammar never ends early
            started = time.thread_time()  # CPU time of this thread: the neighbours' load is not counted
            if step:
                states.begin(held, {})
            result = sample(logits, SamplingBatch.of(
                np.zeros(rows), np.ones(rows), np.zeros(rows), np.full(rows, -1), np.zeros(rows),
                processing=states.processing(held if step else first, "cpu"),
            ))
            states.append(np.arange(rows, dtype=np.int64), result.token_ids.numpy(), result.finite.numpy())
            times.append(time.thread_time() - started)
        out["constrained" if constrained else "plain"] = _median_ms(times)
    out["added_ms_per_step"] = round(out["constrained"] - out["plain"], 4)
    out["added_us_per_token"] = round(out["added_ms_per_step"] * 1e3 / rows, 1)
    return out


def _walk(compile_s: float, tokens: list[int], fill, consume) -> dict:
    """Along a valid output: each token's mask filled, then the token consumed, both timed."""
    masks, accepts = [], []
    for token in tokens:
        t0 = time.perf_counter()
        fill()
        t1 = time.perf_counter()
        assert consume(token), token
        accepts.append(time.perf_counter() - t1)
        masks.append(t1 - t0)
    return _case(compile_s, masks, accepts)


def _case(compile_s: float, masks: list[float], accepts: list[float]) -> dict:
    return {
        "compile_ms": round(compile_s * 1e3, 2),
        "tokens": len(masks),
        "mask_ms_median": _median_ms(masks),
        "mask_ms_max": round(max(masks) * 1e3, 3),
        "accept_ms_median": _median_ms(accepts),
    }


def _one_side(engine: str, model: str) -> dict:
    from tp_runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(model)
    if engine == "sampler":
        return {f"rows_{rows}": run_sampler_overhead(tokenizer, rows) for rows in (1, 8, 32)}
    return run_llguidance(tokenizer) if engine == "llguidance" else run_xgrammar(tokenizer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="")
    parser.add_argument("--xgrammar-path", default="", help="a directory to add to sys.path for xgrammar")
    parser.add_argument("--side", choices=("llguidance", "xgrammar", "sampler"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.model:
        from executor.model import default_model_path

        args.model = default_model_path()
    if args.side:
        if args.xgrammar_path:
            sys.path.append(args.xgrammar_path)
        print(json.dumps(_one_side(args.side, args.model)))
        return 0
    runs: dict[str, list[dict]] = {"llguidance": [], "xgrammar": []}
    for _ in range(args.rounds):
        for side in runs:
            command = [sys.executable, __file__, "--side", side, "--model", args.model]
            if args.xgrammar_path:
                command += ["--xgrammar-path", args.xgrammar_path]
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                runs[side].append({"error": done.stderr.strip().splitlines()[-1:]})
                continue
            runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    report = {side: _medians(results) for side, results in runs.items()}
    overhead = []
    for _ in range(args.rounds):
        done = subprocess.run([sys.executable, __file__, "--side", "sampler", "--model", args.model],
                              capture_output=True, text=True, cwd=ROOT)
        if done.returncode == 0:
            overhead.append(json.loads(done.stdout.strip().splitlines()[-1]))
    report["sampler_overhead"] = {
        rows: {key: statistics.median(r[rows][key] for r in overhead) for key in overhead[0][rows]}
        for rows in overhead[0]
    } if overhead else {"error": "not measured"}
    print(json.dumps(report, indent=2))
    return 0


def _medians(results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r]
    if not ok:
        return {"error": results[0]["error"] if results else "not run"}
    out = {"rounds": len(ok), "setup_ms": statistics.median(r["setup_ms"] for r in ok), "cases": {}}
    for name in CASES:
        out["cases"][name] = {
            key: statistics.median(r["cases"][name][key] for r in ok) for key in ok[0]["cases"][name]
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
