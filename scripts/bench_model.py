"""Model step benchmark: decode step time by batch, 1024-token prefill, and the cost of clears.

Every decode step runs the executor's per-step path: StepInputs.from_prepare, clear_pages, then
the forward. The floor of a step is the bytes it must read (the weights, plus the KV it attends
over) at this machine's copy bandwidth, measured here with a large tensor copy. A mixed-format
step of few rows reads the int4 copies, a larger one the dense copies: its floor follows.

    python scripts/bench_model.py [--json] [--formats auto,fp32,bf16,int4,mixed] [--steps 15]
    python scripts/bench_model.py --baseline /tmp/model-base --rounds 5   # side by side

`auto` is what `--dtype auto --weight-format auto` resolve to on this CPU (executor/probe.py).
Decode runs the compiled layers (executor/model/compiled.py; `--compile wait` builds them first
if they are not cached yet, `off` runs eager). `--rss-steps N` runs N random steps (decode
batches, and prefill chunks mixed with decodes) and reports the process's RSS along the way.
`--slices` keeps the model loaded and times a batch-1 decode step on demand, for a benchmark that
runs beside it (scripts/bench_serving.py; `serve_slices`).

With `--baseline DIR` (a checkout of another commit, e.g. `git worktree add /tmp/model-base
afdec79`) the two trees' benchmarks run as subprocesses in turn, `--rounds` times, so that a busy
machine slows both alike; the report gives medians per side and the ratios, against the targets
of issue 15.
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

# BENCH_TREE: the checkout whose executor this run measures (--baseline sets it for the other side;
# the code below copes with one from before the probe and the compiled layers, issue 15's base).
sys.path.insert(0, os.environ.get("BENCH_TREE") or str(Path(__file__).resolve().parents[1]))

from executor.allocator import retain_freed_memory  # noqa: E402
from executor.cache import KVCache  # noqa: E402
from executor.inputs import StepInputs  # noqa: E402
from executor.model import TORCH_DTYPES, LlamaModel, default_model_path, load_model  # noqa: E402
try:
    from executor.kernels import INT4_MAX_ROWS  # noqa: E402
except ImportError:  # a baseline checkout, from before executor/kernels.py
    from executor.model.layers import INT4_MAX_ROWS  # noqa: E402
from protocol.frames import Prepare  # noqa: E402

try:
    from executor.probe import probe_cpu  # noqa: E402
except ImportError:  # a baseline checkout
    probe_cpu = None
try:
    from executor.model.runner import ModelRunner  # noqa: E402
except ImportError:  # a checkout whose model picks its own runner
    ModelRunner = None

# name -> (activation dtype, weight format); auto: the probe's dtype with --weight-format auto
FORMATS = {
    "auto": (None, "auto"),
    "fp32": (torch.float32, "dense"),
    "bf16": (torch.bfloat16, "dense"),
    "int4": (torch.bfloat16, "int4"),
    "mixed": (torch.bfloat16, "mixed"),
}
PAGE_SIZE = 16
CONTEXT = 128  # the default of --context: tokens already in each sequence's cache at a decode step
PREFILL_TOKENS = 1024


@dataclass
class DecodeResult:
    batch: int
    step_ms: float  # median
    min_step_ms: float  # the fastest step: on a busy shared machine, the closest to the CPU's own speed
    tokens_per_s: float
    bytes_per_step: int
    floor_ms: float
    fraction_of_floor: float


@dataclass
class FormatResult:
    weight_format: str
    resolved: str  # the dtype and weight format the model loaded with
    compiled_decode: bool  # decode steps ran the compiled layers
    weight_bytes: int
    decode: list[DecodeResult]
    prefill_tokens: int
    prefill_ms: float
    prefill_min_ms: float
    prefill_tokens_per_s: float
    prefill_floor_ms: float
    # A server's steady step at high concurrency: decodes plus one new prompt's prefill chunk,
    # every prefill row on the dense copies and the decodes beside it eager (--mixed).
    mixed_decodes: int
    mixed_prompt: int
    mixed_ms: float
    clear_on_ms: float
    clear_off_ms: float
    clear_cost_percent: float
    clear_alone_us: float  # the batch-32 step's clear_pages call timed alone
    batch32_over_batch1: float


def copy_bandwidth(megabytes: int = 512, repeats: int = 7, device: str = "cpu") -> float:
    """Bytes per second moved by a large tensor copy, counting the read and the write."""
    source = torch.ones(megabytes * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    sync = torch.cuda.synchronize if source.is_cuda else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        target.copy_(source)
        sync()
        times.append(time.perf_counter() - start)
    return 2 * source.numel() * 4 / statistics.median(times)


def weight_bytes(model: LlamaModel, rows: int, sampled: int) -> int:
    """Bytes a step of `rows` tokens, `sampled` of them sampled, reads from weights: every layer
    matrix and the LM head (not the embedding table: a step reads only its rows)."""
    total = model.lm_head.linear.bytes_read(sampled)
    for layer in model.layers:
        total += sum(linear.bytes_read(rows) for linear in (layer.qkv, layer.o, layer.gate_up, layer.down))
        total += sum(t.numel() * t.element_size() for t in (layer.attn_norm, layer.ffn_norm))
    return total


def make_prepare(
    tokens: list[list[int]], contexts: list[int], cleared: list[int], vocab: int
) -> Prepare:
    """One step: sequence i brings tokens[i] and then holds contexts[i] tokens in pages
    [i * pages_per_seq, ...)."""
    n = len(tokens)
    pages_per_seq = -(-max(contexts) // PAGE_SIZE)
    return Prepare.greedy(
        query_lens=[len(t) for t in tokens],
        context_lens=contexts,
        token_ids=[x % vocab for t in tokens for x in t],
        page_table_lens=[pages_per_seq] * n,
        page_table=np.arange(n * pages_per_seq),
        cleared_pages=sorted(cleared),
    )


def run_step(model: LlamaModel, cache: KVCache, prepare: Prepare) -> float:
    start = time.perf_counter()
    cache.clear_pages(prepare.cleared_pages)
    inputs = StepInputs.from_prepare(
        prepare, pad_page=cache.pad_page, page_size=cache.page_size, device=model.device
    )
    logits = model.forward(inputs, cache)
    if logits is not None:
        logits.argmax(dim=-1)
    return time.perf_counter() - start


def new_cache(model: LlamaModel, num_kv_pages: int) -> KVCache:
    cache = KVCache(
        num_kv_pages=num_kv_pages,
        page_size=PAGE_SIZE,
        num_layers=model.config.num_layers,
        num_kv_heads=model.shard.local_kv_heads,
        head_dim=model.config.head_dim,
        kv_dtype="bf16" if model.dtype == torch.bfloat16 else "fp32",
        device=model.device,
    )
    cache.clear_pages(np.arange(num_kv_pages, dtype=np.int32))
    return cache


def load(path: str, name: str, compile_mode: str) -> LlamaModel:
    dtype, weight_format = FORMATS[name]
    if dtype is None:
        if probe_cpu is None:
            raise SystemExit("format auto needs executor.probe, which this checkout has not")
        dtype = TORCH_DTYPES[probe_cpu().dtype]
    options = {"compile_mode": compile_mode} if "compile_mode" in inspect.signature(load_model).parameters else {}
    model = load_model(
        path, rank=0, world_size=1, dtype=dtype, device=torch.device("cpu"), weight_format=weight_format, **options
    )
    # Steps run as the executor runs them: the runner picks eager or compiled layers per step.
    return model if ModelRunner is None else ModelRunner(model)


def resolved_format(model: LlamaModel) -> str:
    layer = model.layers[0].qkv
    kind = "mixed" if layer.int4 is not None and layer.weight is not None else "int4" if layer.int4 is not None else "dense"
    rows = f" (int4 up to {getattr(layer, 'int4_max_rows', INT4_MAX_ROWS)} rows)" if kind == "mixed" else ""
    return f"{str(model.dtype).removeprefix('torch.')} {kind}{rows}"


def compiled_decode(model: LlamaModel, cache: KVCache, vocab: int) -> bool:
    """Whether a batch-1 decode step runs compiled layers (in this tree, or in a baseline's)."""
    if hasattr(model, "compiled_decode"):  # a baseline checkout
        compiled = model.compiled_decode(cache)
        return compiled is not None and compiled.covers(1)
    run_step(model, cache, make_prepare([[7]], [2], [], vocab))
    return model.last_runner == "compiled"


@dataclass
class Bench:
    """One loaded format and a cache that holds every table its steps use."""

    model: LlamaModel
    cache: KVCache
    context: int
    spare_pages: list[int]  # at the pool's end, in no table: the clears' targets

    @property
    def vocab(self) -> int:
        return self.model.config.vocab_size

    def timed(self, prepare: Prepare, runs: int) -> list[float]:
        """Seconds per step, after one untimed warm-up step."""
        run_step(self.model, self.cache, prepare)
        return [run_step(self.model, self.cache, prepare) for _ in range(runs)]


def bench_format(
    path: str, name: str, steps: int, batches: list[int], bandwidth: float, compile_mode: str,
    context: int, mixed: tuple[int, int],
) -> FormatResult:
    model = load(path, name, compile_mode)
    spare = 8
    # make_prepare gives every sequence of a step as many pages as its longest needs.
    mixed_pages = (mixed[0] + 1) * -(-max(context + 1, mixed[1]) // PAGE_SIZE)
    tables = max(max(batches) * -(-(context + 1) // PAGE_SIZE), mixed_pages, -(-PREFILL_TOKENS // PAGE_SIZE))
    cache = new_cache(model, tables + spare)
    bench = Bench(model, cache, context, list(range(tables, tables + spare)))
    kv_bytes_per_token = cache.page_bytes // PAGE_SIZE

    decode, clear_on, clear_off = bench_decode(bench, batches, steps, bandwidth)
    prefill_times = bench.timed(make_prepare([list(range(100, 100 + PREFILL_TOKENS))], [PREFILL_TOKENS], [], bench.vocab), max(3, steps // 5))
    prefill_s = statistics.median(prefill_times)
    mixed_step = make_prepare(
        [[7 + i] for i in range(mixed[0])] + [list(range(100, 100 + mixed[1]))],
        [context + 1] * mixed[0] + [mixed[1]], [], bench.vocab,
    )
    mixed_s = statistics.median(bench.timed(mixed_step, max(3, steps // 2)))
    on = statistics.median(clear_on) if clear_on else float("nan")
    off = statistics.median(clear_off) if clear_off else float("nan")
    step_ms = {d.batch: d.step_ms for d in decode}
    return FormatResult(
        weight_format=name,
        resolved=resolved_format(model),
        compiled_decode=compiled_decode(model, cache, bench.vocab),
        weight_bytes=weight_bytes(model, 1, 1),
        decode=decode,
        prefill_tokens=PREFILL_TOKENS,
        prefill_ms=prefill_s * 1e3,
        prefill_min_ms=min(prefill_times) * 1e3,
        prefill_tokens_per_s=PREFILL_TOKENS / prefill_s,
        prefill_floor_ms=(weight_bytes(model, PREFILL_TOKENS, 1) + PREFILL_TOKENS * kv_bytes_per_token) / bandwidth * 1e3,
        mixed_decodes=mixed[0],
        mixed_prompt=mixed[1],
        mixed_ms=mixed_s * 1e3,
        clear_on_ms=on * 1e3,
        clear_off_ms=off * 1e3,
        clear_cost_percent=(on / off - 1) * 100,
        clear_alone_us=clear_alone_us(cache, bench.spare_pages[: -(-32 // PAGE_SIZE)]),
        batch32_over_batch1=(32 / step_ms[32]) / (1 / step_ms[1]) if 1 in step_ms and 32 in step_ms else float("nan"),
    )


def bench_decode(
    bench: Bench, batches: list[int], steps: int, bandwidth: float
) -> tuple[list[DecodeResult], list[float], list[float]]:
    """Decode steps by batch size, and at batch 32 steps with and without clears, interleaved so
    that machine noise hits both sides alike."""
    model, context = bench.model, bench.context
    kv_bytes_per_token = bench.cache.page_bytes // PAGE_SIZE
    decode, clear_on, clear_off = [], [], []
    for batch in batches:
        tokens, contexts = [[7 + i] for i in range(batch)], [context + 1] * batch
        prepare = make_prepare(tokens, contexts, [], bench.vocab)
        # Steady decode lists about batch / page_size newly committed pages per step.
        with_clears = make_prepare(tokens, contexts, bench.spare_pages[: max(1, -(-batch // PAGE_SIZE))], bench.vocab)
        for _ in range(2):
            run_step(model, bench.cache, prepare)
        times = []
        for _ in range(steps):
            if batch == 32:
                clear_on.append(run_step(model, bench.cache, with_clears))
                clear_off.append(run_step(model, bench.cache, prepare))
            times.append(run_step(model, bench.cache, prepare))
        step = statistics.median(times)
        step_bytes = weight_bytes(model, batch, batch) + batch * (context + 1) * kv_bytes_per_token
        floor = step_bytes / bandwidth
        decode.append(
            DecodeResult(batch, step * 1e3, min(times) * 1e3, batch / step, step_bytes, floor * 1e3, floor / step)
        )
    return decode, clear_on, clear_off


def serve_slices(
    path: str, name: str, context: int, compile_mode: str, lines: Iterable[str], out: TextIO
) -> None:
    """Batch-1 decode steps timed on demand: once loaded, one line `{"ready": true}`; then for each
    line read, a count of steps, the median of that many steps as `{"step_s": ..., "steps": ...}`.
    A benchmark beside it times the model's step right before and after each of its measurements:
    a shared host's memory bandwidth has slow spells of ~15 s that move this step by up to ~2x
    (docs/control_plane.md, the twenty-sixth sitting), so a step timed once a run says little about
    a level measured a minute later."""
    model = load(path, name, compile_mode)
    bench = Bench(model, new_cache(model, -(-(context + 1) // PAGE_SIZE)), context, [])
    step = make_prepare([[7]], [context + 1], [], bench.vocab)
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in lines:
        steps = int(line)
        if steps < 1:
            raise ValueError(f"a slice needs at least one step, not {steps}")
        out.write(json.dumps({"step_s": statistics.median(bench.timed(step, steps)), "steps": steps}) + "\n")
        out.flush()


def clear_alone_us(cache: KVCache, pages: list[int], runs: int = 200) -> float:
    """A batch-32 step's clear_pages call timed alone: the A/B difference of whole steps drowns in
    step noise on a shared machine; this does not."""
    page_list = np.asarray(pages, dtype=np.int32)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        cache.clear_pages(page_list)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


@dataclass
class RssResult:
    steps: int
    rss_mib: list[tuple[int, float]]  # (steps run, RSS after malloc_trim)
    growth_first_half_mib: float
    growth_second_half_mib: float


def rss_mib() -> float:
    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def bench_rss(path: str, name: str, steps: int, compile_mode: str, seed: int = 0) -> RssResult:
    """`steps` random steps: half decode batches of 1-32 sequences (compiled where built), half a
    prefill chunk of 1-400 tokens with 0-8 decodes (eager), over contexts of up to 512 tokens in
    a pool of 256 pages that the tables share (the values attended over do not matter here)."""
    model = load(path, name, compile_mode)
    cache = new_cache(model, 256)
    rng = np.random.default_rng(seed)
    vocab, samples = model.config.vocab_size, []
    for step in range(steps + 1):
        if step % max(1, steps // 10) == 0:
            samples.append((step, rss_mib()))
        if rng.random() < 0.5:
            chunks = [[int(t)] for t in rng.integers(0, vocab, int(rng.integers(1, 33)))]
            contexts = [int(c) for c in rng.integers(1, 513, len(chunks))]
        else:
            prompt = int(rng.integers(1, 401))
            chunks = [[int(t) for t in rng.integers(0, vocab, prompt)]]
            chunks += [[int(t)] for t in rng.integers(0, vocab, int(rng.integers(0, 9)))]
            contexts = [prompt + int(rng.integers(0, 112))] + [int(c) for c in rng.integers(1, 513, len(chunks) - 1)]
        tables = [rng.integers(0, 256, -(-c // PAGE_SIZE)) for c in contexts]
        prepare = Prepare.greedy(
            query_lens=[len(t) for t in chunks],
            context_lens=contexts,
            token_ids=[x for t in chunks for x in t],
            page_table_lens=[len(t) for t in tables],
            page_table=np.concatenate(tables),
        )
        run_step(model, cache, prepare)
    half = samples[len(samples) // 2][1]
    return RssResult(steps, samples, half - samples[1][1], samples[-1][1] - half)


def run_tree(tree: Path, args: list[str]) -> dict:
    """This benchmark, run on the checkout at `tree`, as a subprocess."""
    env = {**os.environ, "PYTHONPATH": str(tree), "BENCH_TREE": str(tree)}
    done = subprocess.run(
        [sys.executable, __file__, "--json", *args], env=env, cwd=tree, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{tree}: bench_model failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def compare(args: argparse.Namespace) -> dict:
    """Rounds of the baseline tree's default format and ours, each in its own process, in turn."""
    here = Path(__file__).resolve().parents[1]
    common = ["--batches", args.batches, "--steps", str(args.steps), "--context", str(args.context),
              "--mixed", ",".join(map(str, args.mixed))]
    if args.model:
        common += ["--model", args.model]
    if args.threads:
        common += ["--threads", str(args.threads)]
    # With --compile wait a missing library is built in the first batch's untimed warm-up steps.
    ours_args = [*common, "--formats", args.formats.split(",")[0], "--compile", args.compile]
    # Both trees as they ship: each compiles what it compiles (a baseline that compiles nothing
    # ignores the flag's effect).
    base_args = [*common, "--formats", args.baseline_format, "--compile", args.compile]
    rounds = []
    for index in range(args.rounds):
        pair = {"baseline": run_tree(Path(args.baseline), base_args), "ours": run_tree(here, ours_args)}
        rounds.append(pair)
        print(f"round {index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return summarize(rounds, args)


def summarize(rounds: list[dict], args: argparse.Namespace) -> dict:
    def median(side: str, pick) -> float:  # noqa: ANN001
        return statistics.median(pick(r[side]["formats"][0]) for r in rounds)

    batches = [d["batch"] for d in rounds[0]["ours"]["formats"][0]["decode"]]
    table = {}
    for side in ("baseline", "ours"):
        row = {}
        for i, batch in enumerate(batches):
            row[f"decode_{batch}_ms"] = median(side, lambda f, i=i: f["decode"][i]["step_ms"])
            row[f"decode_{batch}_min_ms"] = median(side, lambda f, i=i: f["decode"][i]["min_step_ms"])
            row[f"decode_{batch}_tok_s"] = median(side, lambda f, i=i: f["decode"][i]["tokens_per_s"])
            row[f"decode_{batch}_of_floor"] = median(side, lambda f, i=i: f["decode"][i]["fraction_of_floor"])
        row["prefill_ms"] = median(side, lambda f: f["prefill_ms"])
        row["mixed_ms"] = median(side, lambda f: f["mixed_ms"])
        row["prefill_min_ms"] = median(side, lambda f: f["prefill_min_ms"])
        row["prefill_tok_s"] = median(side, lambda f: f["prefill_tokens_per_s"])
        row["clear_alone_us"] = median(side, lambda f: f["clear_alone_us"])
        row["copy_bandwidth_gb_s"] = statistics.median(r[side]["copy_bandwidth_gb_s"] for r in rounds)
        table[side] = row
    ours, base = table["ours"], table["baseline"]
    targets = {}
    if 1 in batches:
        targets["batch 1 at >= 50% of its floor"] = (ours["decode_1_of_floor"], ours["decode_1_of_floor"] >= 0.5)
    if 32 in batches:
        ratio = ours["decode_32_tok_s"] / base["decode_32_tok_s"]
        targets["batch 32 >= 1.5x baseline tok/s"] = (ratio, ratio >= 1.5)
        clear = ours["clear_alone_us"] / 1e3 / ours["decode_32_ms"]
        targets["clears <= 1% of a batch-32 step"] = (clear, clear <= 0.01)
    prefill = base["prefill_ms"] / ours["prefill_ms"]
    targets["1024-token prefill >= 1.5x baseline"] = (prefill, prefill >= 1.5)
    if 1 in batches and 8 in batches:
        ratio = ours["decode_8_ms"] / ours["decode_1_ms"]
        targets["a batch-8 step <= 2 batch-1 steps"] = (ratio, ratio <= 2.0)
    return {
        "rounds": len(rounds),
        "baseline": {"tree": args.baseline, "format": args.baseline_format, "medians": base},
        "ours": {"format": rounds[0]["ours"]["formats"][0]["resolved"], "compiled_decode": rounds[0]["ours"]["formats"][0]["compiled_decode"], "medians": ours},
        "targets": {name: {"value": value, "met": met} for name, (value, met) in targets.items()},
        "raw": rounds,
    }


def print_comparison(report: dict) -> None:
    base, ours = report["baseline"]["medians"], report["ours"]["medians"]
    print(
        f"medians of {report['rounds']} rounds; baseline {report['baseline']['tree']} ({report['baseline']['format']}) "
        f"against ours ({report['ours']['format']}, compiled decode: {report['ours']['compiled_decode']})"
    )
    print(f"{'':24}{'baseline':>12}{'ours':>12}{'ratio':>9}")
    for key in base:
        faster = key.endswith("_ms") or key.endswith("_us")
        ratio = base[key] / ours[key] if faster else ours[key] / base[key]
        print(f"{key:24}{base[key]:12.3f}{ours[key]:12.3f}{ratio:8.2f}x")
    for name, target in report["targets"].items():
        print(f"  {'met' if target['met'] else 'NOT met':8} {name}: {target['value']:.3f}")


def _mixed(text: str) -> tuple[int, int]:
    try:
        decodes, prompt = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not DECODES,PROMPT (two integers)") from None
    if decodes < 0 or prompt < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: DECODES must be >= 0 and PROMPT >= 2")
    return decodes, prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--formats", default="auto,fp32,bf16,mixed",
        help="comma-separated: auto (what --dtype/--weight-format auto pick here), fp32, bf16 (dense "
        "weights), int4 (4-bit matrices, bf16 activations), mixed",
    )
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2)")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per batch size")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--compile", choices=("wait", "off"), default="wait", help="compiled decode layers")
    parser.add_argument("--rss-steps", type=int, default=0, help="also run this many random steps, reporting RSS")
    parser.add_argument(
        "--slices", action="store_true",
        help="keep the one format of --formats loaded and, for each count of steps read from stdin, print the "
        "median batch-1 decode step of that many as a JSON line",
    )
    parser.add_argument("--baseline", default=None, help="a checkout to compare against, side by side")
    parser.add_argument("--baseline-format", default="mixed", help="the baseline's format (its default: mixed)")
    parser.add_argument("--rounds", type=int, default=5, help="with --baseline: rounds of both")
    parser.add_argument(
        "--context", type=int, default=CONTEXT, help="tokens in each decoding sequence's cache before its step"
    )
    parser.add_argument(
        "--mixed", type=_mixed, default=(31, 256), metavar="DECODES,PROMPT",
        help="the mixed step timed: DECODES sequences decoding beside one PROMPT-token prefill (default 31,256)",
    )
    args = parser.parse_args()
    names = args.formats.split(",")
    unknown = sorted(set(names) - set(FORMATS))
    if unknown:
        parser.error(f"unknown formats {unknown}; choose from {', '.join(FORMATS)}")
    if args.slices and (len(names) != 1 or args.baseline):
        parser.error("--slices times one format of this tree: give --formats one name and no --baseline")
    if args.baseline:
        report = compare(args)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print_comparison(report)
        return
    retain_freed_memory()  # as the executor does
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    if args.slices:
        serve_slices(path, names[0], args.context, args.compile, sys.stdin, sys.stdout)
        return
    bandwidth = copy_bandwidth()
    batches = [int(b) for b in args.batches.split(",")]
    results = [
        bench_format(path, name, args.steps, batches, bandwidth, args.compile, args.context, args.mixed)
        for name in names
    ]
    report = {
        "model": Path(path).name,
        "threads": torch.get_num_threads(),
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "context_tokens": args.context,
        "page_size": PAGE_SIZE,
        "formats": [asdict(r) for r in results],
    }
    if args.rss_steps:
        report["rss"] = asdict(bench_rss(path, names[0], args.rss_steps, args.compile))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report, results, names[0])


def print_report(report: dict, results: list[FormatResult], rss_format: str) -> None:
    bandwidth = report["copy_bandwidth_gb_s"] * 1e9
    print(f"{report['model']}: copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write), {report['threads']} threads")
    for r in results:
        print(
            f"\n{r.weight_format} ({r.resolved}, compiled decode: {r.compiled_decode}): "
            f"{r.weight_bytes / 1e6:.0f} MB of weights read by a batch-1 step"
        )
        for d in r.decode:
            print(
                f"  decode batch {d.batch:3d}: {d.step_ms:8.2f} ms/step (fastest {d.min_step_ms:.2f}) "
                f"{d.tokens_per_s:8.1f} tok/s  floor {d.floor_ms:6.2f} ms ({d.fraction_of_floor:.0%} of floor speed)"
            )
        print(
            f"  prefill {r.prefill_tokens} tokens: {r.prefill_ms:.0f} ms, "
            f"{r.prefill_tokens_per_s:.0f} tok/s (weight floor {r.prefill_floor_ms:.1f} ms)"
        )
        print(f"  mixed: {r.mixed_decodes} decodes + a {r.mixed_prompt}-token prompt: {r.mixed_ms:.0f} ms")
        print(f"  batch-32 aggregate / batch-1: {r.batch32_over_batch1:.1f}x")
        print(
            f"  clears at batch 32: on {r.clear_on_ms:.2f} ms, off {r.clear_off_ms:.2f} ms "
            f"({r.clear_cost_percent:+.2f}%); the clear alone {r.clear_alone_us:.1f} us "
            f"({r.clear_alone_us / 1e3 / r.clear_off_ms:.3%} of the step)"
        )
    if "rss" in report:
        rss = report["rss"]
        print(f"\nRSS over {rss['steps']} random steps ({rss_format}): " + ", ".join(f"{s}: {m:.0f} MiB" for s, m in rss["rss_mib"]))
        print(f"  growth: first half {rss['growth_first_half_mib']:+.1f} MiB, second half {rss['growth_second_half_mib']:+.1f} MiB")


if __name__ == "__main__":
    main()
