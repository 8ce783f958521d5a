"""Benchmark of the wire protocol, side by side with the way SGLang ships a step to its TP workers.

1. Codec: encode, decode, encode+decode (and the HMAC alone, validation, and applying the page-table
   deltas to the tables an executor holds, two steps: whole tables, then the deltas) of a steady
   decode-batch PREPARE: n sequences of 64 pages, one in 16 of them given a new page (the rest of
   each table is held), 64 cleared pages. `full_table_frame_bytes` is the same step with every table
   whole (a step after an abort). `message_encode` and `message_decode`: a message made, and one
   read (authenticated and decoded), in the thread's CPU clock, warm and right after --cold-mb of
   memory has been read through the caches (cold), as a forward streams its weights between two of
   the frontend's frames.
   `fast_paths`: what the codec does now against the two fast paths it used to have, side by side in
   this run: the HMAC by `hmac.new` against RFC 2104 by hand on pre-keyed hashlib objects, and the
   body by its dataclass constructor against filling a frozen dataclass's __dict__ (docs/protocol.md
   has the numbers that retired them).
2. Step round trip over ipc:// with 1, 2, 4 executor processes, both sides driven by
   protocol.conversation: the scheduler sends PREPARE to all, each executor decodes, checks and
   validates it and answers READY, the scheduler sends GO once all are READY. Timed from the first
   PREPARE send to the last GO send (RESULT and DONE drained untimed).
3. Baseline in the same run: the same step as a dict of lists/ndarrays, pickled and sent with
   torch.distributed.broadcast_object_list over gloo from one sender to the same number of
   receivers, followed by a barrier so that the sender knows every receiver has it (what READY
   tells our scheduler). Also the broadcast alone, as the sender sees it.

Usage: python scripts/bench_protocol.py [--json] (about 2 minutes on 2 idle cores; --help for the knobs)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import os
import pickle
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from protocol.codec import decode, decode_verified, encode, frame_mac, open_message, to_message  # noqa: E402
from protocol.conversation import StepDone, StepReady  # noqa: E402
from protocol.frames import ARRAY_DTYPES, PROTOCOL_VERSION, CacheGeometry, Frame, Prepare, plain_sampling  # noqa: E402
from protocol.page_tables import HeldPageTables  # noqa: E402
from protocol.transport import SchedulerEndpoint, ipc_address  # noqa: E402
from protocol.validate import validate_prepare  # noqa: E402
from tests.protocol.wire_peers import SchedulerDriver, run_executor  # noqa: E402

KEY = os.urandom(32)
RUN_ID = "bench"
PAGES_PER_SEQ = 64
CLEARED = 64
PAGE_SIZE = 16
GEOMETRY = CacheGeometry(
    num_kv_pages=1 << 20,
    page_size=PAGE_SIZE,
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
    kv_dtype="bf16",
    vocab_size=49152,
    max_model_len=8192,
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
)
TIMEOUT_MS = 30_000


def decode_batch_prepare(n: int, *, delta: bool = False) -> Prepare:
    """A decode step; with `delta`, one sequence in 16 opens its last page and the rest of every
    table is what the executors hold (the steady state of decoding with page_size 16)."""
    rng = np.random.default_rng(n)
    context = PAGES_PER_SEQ * PAGE_SIZE - 5
    dt = ARRAY_DTYPES[Prepare]
    table = rng.integers(0, GEOMETRY.num_kv_pages, (n, PAGES_PER_SEQ))
    base = np.zeros(n, dtype=np.int64)
    if delta:
        base[:] = PAGES_PER_SEQ
        base[::16] -= 1
    sent = np.arange(PAGES_PER_SEQ) >= base[:, None]
    arrays = {
        "seq_ids": np.arange(n),
        "query_lens": np.ones(n),
        "context_lens": np.full(n, context),
        "token_ids": rng.integers(0, GEOMETRY.vocab_size, n),
        "positions": np.full(n, context - 1),
        "page_table_lens": np.full(n, PAGES_PER_SEQ),
        "page_table_base": base,
        "page_table": table[sent],
        "sample": np.ones(n),
        "temperature": np.full(n, 0.7),
        "top_p": np.full(n, 0.9),
        "top_k": np.full(n, 50),
        "seeds": np.full(n, -1),
        "cleared_pages": np.sort(rng.choice(GEOMETRY.num_kv_pages, CLEARED, replace=False)),
        "restore_pages": [],
        "restore_slots": [],
        "offload_pages": [],
        "offload_slots": [],
        "poison_pages": [],
        "feedback": np.zeros(n),
        **plain_sampling(n),
    }
    return Prepare(**{name: np.asarray(v, dtype=dt[name]) for name, v in arrays.items()})


def sglang_payload(p: Prepare) -> dict:
    """The same step the way SGLang's scheduler broadcasts it: Python lists and a page-table array."""
    n = len(p.seq_ids)
    return {
        "rids": [f"req-{i}" for i in p.seq_ids.tolist()],
        "input_ids": p.token_ids.tolist(),
        "positions": p.positions.tolist(),
        "seq_lens": p.context_lens.tolist(),
        "extend_lens": p.query_lens.tolist(),
        "req_to_token": p.page_table.reshape(n, -1) if n else p.page_table,
        "sampling": {
            "temperature": p.temperature.tolist(),
            "top_p": p.top_p.tolist(),
            "top_k": p.top_k.tolist(),
            "seeds": p.seeds.tolist(),
        },
        "cleared_pages": p.cleared_pages.tolist(),
    }


def stats_us(samples_ns: list[int]) -> dict[str, float]:
    s = sorted(samples_ns)
    return {
        "median_us": round(statistics.median(s) / 1e3, 2),
        "p99_us": round(s[min(len(s) - 1, int(len(s) * 0.99))] / 1e3, 2),
    }


def time_calls(fn, reps: int, clock=time.perf_counter_ns, sweep: np.ndarray | None = None) -> list[int]:
    """Each call's time by `clock`; with `sweep`, each right after it has been read through the
    caches (no warm-up), as a model's forward streams its weights through them between two of the
    frontend's frames. The sweep is an upper bound: served at concurrency 32 a frame's MAC took 49
    us of the 134 it takes here (docs/control_plane.md, the twenty-first sitting)."""
    for _ in range(0 if sweep is not None else min(20, reps)):
        fn()
    out = []
    for _ in range(reps):
        if sweep is not None:
            sweep.sum()
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def bench_codec(sizes: list[int], reps: int, cold_mb: int = 0, cold_reps: int = 0) -> list[dict]:
    rows = []
    sweep = np.ones(cold_mb << 18, dtype=np.float32) if cold_mb and cold_reps else None
    for n in sizes:
        full = decode_batch_prepare(n)
        frame = Frame(PROTOCOL_VERSION, 1, RUN_ID, 1, 1, decode_batch_prepare(n, delta=True))
        parts = encode(frame, KEY)
        payload = sglang_payload(full)
        held = HeldPageTables()
        base = frame.body.page_table_base
        # The step before: the same tables without the pages this one adds.
        before = dataclasses.replace(
            full,
            page_table_lens=base,
            page_table=full.page_table.reshape(n, -1)[np.arange(PAGES_PER_SEQ) < base[:, None]] if n else full.page_table,
        )

        def apply_deltas() -> None:
            held.apply(before)
            held.apply(frame.body)

        rows.append(
            {
                "seqs": n,
                "frame_bytes": sum(len(p) for p in parts),
                "full_table_frame_bytes": sum(len(p) for p in encode(Frame(PROTOCOL_VERSION, 1, RUN_ID, 1, 1, full), KEY)),
                "encode": stats_us(time_calls(lambda: encode(frame, KEY), reps)),
                "decode": stats_us(time_calls(lambda: decode(parts, KEY), reps)),
                "encode_decode": stats_us(time_calls(lambda: decode(encode(frame, KEY), KEY), reps)),
                "hmac_one_side": stats_us(time_calls(lambda: frame_mac(KEY, parts[:-1]), reps)),
                "validate": stats_us(time_calls(lambda: validate_prepare(frame.body, GEOMETRY), reps)),
                "apply_before_then_delta": stats_us(time_calls(apply_deltas, reps)),
                "pickle_dumps_loads": stats_us(time_calls(lambda: pickle.loads(pickle.dumps(payload)), reps)),
            }
        )
        if sweep is not None:
            message = to_message(parts)
            made = lambda: to_message(encode(frame, KEY))  # noqa: E731
            read = lambda: decode_verified(open_message([message], KEY))  # noqa: E731
            for name, fn in (("message_encode", made), ("message_decode", read)):
                rows[-1][name] = {
                    "warm": stats_us(time_calls(fn, reps, time.thread_time_ns)),
                    "cold": stats_us(time_calls(fn, cold_reps, time.thread_time_ns, sweep)),
                }
    return rows


def hmac_by_hand(key: bytes) -> Callable[[list[bytes]], bytes]:
    """The HMAC fast path the codec had: RFC 2104 on hashlib objects keyed once, copied per frame
    (measured here against hmac.new, which replaced it)."""
    block = key.ljust(64, b"\0")
    inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
    outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def mac(parts: list[bytes]) -> bytes:
        h = inner.copy()
        h.update(struct.pack(f"<{len(parts) + 1}Q", len(parts), *map(len, parts)))
        for p in parts:
            h.update(p)
        o = outer.copy()
        o.update(h.digest())
        return o.digest()

    return mac


def bench_fast_paths(sizes: list[int], reps: int) -> list[dict]:
    """Each retired fast path and what replaced it, alternating in one run."""
    rows = []
    for n in sizes:
        frame = Frame(PROTOCOL_VERSION, 1, RUN_ID, 1, 1, decode_batch_prepare(n, delta=True))
        parts = encode(frame, KEY)[:-1]
        by_hand = hmac_by_hand(KEY)
        if by_hand(parts) != frame_mac(KEY, parts):
            raise RuntimeError("the two HMACs disagree")
        fields = {f.name: getattr(frame.body, f.name) for f in dataclasses.fields(Prepare)}

        def fill_dict() -> Prepare:
            obj = object.__new__(Prepare)
            obj.__dict__.update(fields)
            return obj

        mac_now, mac_then, build_now, build_then = [], [], [], []
        for _ in range(5):
            mac_now += time_calls(lambda: frame_mac(KEY, parts), reps // 5)
            mac_then += time_calls(lambda: by_hand(parts), reps // 5)
            build_now += time_calls(lambda: Prepare(**fields), reps // 5)
            build_then += time_calls(fill_dict, reps // 5)
        rows.append(
            {
                "seqs": n,
                "hmac_new": stats_us(mac_now),
                "hmac_by_hand": stats_us(mac_then),
                "prepare_constructor": stats_us(build_now),
                "prepare_dict_fill": stats_us(build_then),
            }
        )
    return rows


def bench_round_trip(world: int, n: int, iters: int, warmup: int) -> list[int]:
    """Round-trip times in ns, PREPARE out to GO out, with `world` executor processes."""
    ctx = multiprocessing.get_context("spawn")
    endpoint = SchedulerEndpoint(ipc_address("bench"), KEY, RUN_ID)
    args = (endpoint.address, KEY, RUN_ID)
    procs = [ctx.Process(target=run_executor, args=(*args, r, world, GEOMETRY), daemon=True) for r in range(world)]
    driver = SchedulerDriver(endpoint, world, RUN_ID, timeout_s=TIMEOUT_MS / 1000)
    try:
        for p in procs:
            p.start()
        driver.handshake()
        prepare = decode_batch_prepare(n, delta=True)
        samples = []
        for i in range(warmup + iters):
            t0 = time.perf_counter_ns()
            step = driver.prepare(prepare)
            driver.expect(StepReady)
            endpoint.send_all(driver.conv.ranks, *driver.conv.go(step))
            t1 = time.perf_counter_ns()
            driver.expect(StepDone)
            if i >= warmup:
                samples.append(t1 - t0)
        return samples
    finally:
        driver.shutdown("benchmark over")
        stop(procs)
        endpoint.close()


def stop(procs: list[multiprocessing.Process]) -> None:
    for p in procs:
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
            p.join()


def _baseline_rank(rank: int, world_size: int, port: int, n: int, iters: int, warmup: int, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    payload = sglang_payload(decode_batch_prepare(n)) if rank == 0 else None
    delivered, broadcast_only = [], []
    for i in range(warmup + iters):
        box = [payload]
        t0 = time.perf_counter_ns()
        dist.broadcast_object_list(box, src=0)
        t1 = time.perf_counter_ns()
        dist.barrier()
        t2 = time.perf_counter_ns()
        if rank != 0 and len(box[0]["input_ids"]) != n:
            raise RuntimeError("the broadcast payload arrived damaged")
        if i >= warmup:
            broadcast_only.append(t1 - t0)
            delivered.append(t2 - t0)
    if rank == 0:
        results.put((delivered, broadcast_only))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_baseline(receivers: int, n: int, iters: int, warmup: int) -> tuple[list[int], list[int]]:
    """broadcast_object_list from one sender to `receivers` ranks (as many processes as our round
    trip): ns per broadcast + barrier, and per broadcast alone as the sender sees it."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    world_size = receivers + 1
    port = free_port()
    procs = [
        ctx.Process(target=_baseline_rank, args=(r, world_size, port, n, iters, warmup, results), daemon=True)
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        return results.get(timeout=300)
    finally:
        stop(procs)


def compare(world: int, n: int, args: argparse.Namespace, say) -> tuple[dict, dict | None, dict | None]:
    """Ours and the baseline in alternating rounds, so that load from other processes on the
    machine falls on both alike."""
    ours: list[int] = []
    delivered: list[int] = []
    broadcast_only: list[int] = []
    for r in range(args.rounds):
        say(f"round {r + 1}/{args.rounds}: {world} executors, {n} seqs: ours ...")
        ours += bench_round_trip(world, n, args.iters, args.warmup)
        if not args.no_baseline:
            say(f"round {r + 1}/{args.rounds}: {world} receivers, {n} seqs: broadcast_object_list ...")
            d, b = bench_baseline(world, n, args.iters, args.warmup)
            delivered += d
            broadcast_only += b
    row = {"executors": world, "seqs": n, **stats_us(ours)}
    if args.no_baseline:
        return row, None, None
    base = {
        "receivers": world,
        "seqs": n,
        "broadcast_and_barrier": stats_us(delivered),
        "broadcast_only_sender_view": stats_us(broadcast_only),
    }
    ratio = {
        "executors": world,
        "seqs": n,
        "baseline_over_ours": round(base["broadcast_and_barrier"]["median_us"] / row["median_us"], 2),
    }
    return row, base, ratio


def targets(report: dict) -> dict:
    """Issue 2's targets, where this run measured them."""
    out: dict = {}
    for row in report["codec"]:
        if row["seqs"] == 256:
            us = row["encode_decode"]["median_us"]
            out["encode_decode_256_under_50us"] = {"median_us": us, "met": us < 50}
    for row in report["round_trip"]:
        if row["executors"] == 4 and row["seqs"] == 256:
            us = row["median_us"]
            out["round_trip_4_executors_under_250us"] = {"median_us": us, "met": us < 250}
    for row in report["ratios"]:
        if row["executors"] == 4 and row["seqs"] == 256:
            ratio = row["baseline_over_ours"]
            out["at_least_5x_baseline_at_4"] = {"ratio": ratio, "met": ratio >= 5}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1, 64, 256, 1024], help="sequences per PREPARE"
    )
    parser.add_argument("--executors", type=int, nargs="+", default=[1, 2, 4], help="executor process counts")
    parser.add_argument(
        "--rt-seqs", type=int, nargs="+", default=[256], help="PREPARE sizes for the round trips"
    )
    parser.add_argument("--reps", type=int, default=300, help="codec repetitions per measurement")
    parser.add_argument(
        "--cold-mb", type=int, default=256,
        help="message_encode and message_decode (a message made and read) are timed warm and after "
        "reading this many MB (0: neither)",
    )  # fmt: skip
    parser.add_argument("--cold-reps", type=int, default=40, help="cold repetitions per measurement")
    parser.add_argument("--iters", type=int, default=150, help="round trips per configuration and round")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of ours and the baseline")
    parser.add_argument("--no-baseline", action="store_true", help="skip the torch.distributed baseline")
    args = parser.parse_args()

    def say(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    load_start = round(os.getloadavg()[0], 2)
    say("codec ...")
    report: dict = {"codec": bench_codec(args.sizes, args.reps, args.cold_mb, args.cold_reps), "round_trip": [], "baseline": []}
    say("fast paths ...")
    report["fast_paths"] = bench_fast_paths(args.sizes, args.reps * 4)
    report["ratios"] = []
    for n in args.rt_seqs:
        for world in args.executors:
            row, base, ratio = compare(world, n, args, say)
            report["round_trip"].append(row)
            if base is not None:
                report["baseline"].append(base)
                report["ratios"].append(ratio)
    report["targets"] = targets(report)
    # Other processes on the machine inflate every number here; say how busy it was.
    report["load_average_1min"] = {"start": load_start, "end": round(os.getloadavg()[0], 2)}
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
