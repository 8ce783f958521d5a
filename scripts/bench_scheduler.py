"""Scheduler benchmark: time to plan a step and encode its PREPARE, prefix-sharing admission, pressure.

    python scripts/bench_scheduler.py [--json] [--quick] [--tree DIR]

--tree runs the same cases against the scheduler of another checkout (e.g. an older commit, for a
side-by-side comparison): only the public API that every version has is used.

Cases
- decode_N: N running sequences, all decoding (contexts 256..768 tokens, page size 16): median and
  p99 of plan_step + protocol encode, and of on_result, over many steps.
- pool_size: the same 256-sequence decode step (contexts 128..224) with a 16k-page and a 256k-page
  pool: the cost must not follow the pool size.
- prefix_sharing: 256 requests whose prompts share a 1024-token prefix that is already cached:
  the total of their add_request calls and of the step that admits them all (median of 9 runs),
  with int32 arrays (what the engine passes: it converts on the HTTP thread) and with tuples of
  ints (a direct caller's lists).
- pressure: a pool too small for the load (evictions, preemptions by recompute and offload).
- decode_pipelined_N: the decode_N case with max_inflight_steps 2, as the overlapped engine drives
  it: step N+1 is planned and encoded (every row feeding back step N's sample) before step N's
  RESULT is taken (only on trees whose scheduler has the setting).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def _tree() -> str:
    if "--tree" in sys.argv:
        return os.path.abspath(sys.argv[sys.argv.index("--tree") + 1])
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


sys.path.insert(0, _tree())

from protocol.codec import encode  # noqa: E402
from protocol.frames import LAYOUT_VERSION, PROTOCOL_VERSION, Frame, Result  # noqa: E402
from scheduler import SamplingParams, Scheduler, SchedulerConfig  # noqa: E402

KEY = os.urandom(32)
PAGE = 16


def fake_result(plan) -> Result:
    idx = np.flatnonzero(plan.prepare.sample)
    n = idx.shape[0]
    return Result(
        seq_ids=plan.prepare.seq_ids[idx],
        token_ids=np.full(n, 7, dtype=np.int32),
        logprobs=np.zeros(n, dtype=np.float32),
        finite=np.ones(n, dtype=np.uint8),
    )


def encode_plan(plan, seq: int) -> list[bytes]:
    frame = Frame(PROTOCOL_VERSION, LAYOUT_VERSION, "bench", plan.step, seq, plan.prepare)
    return encode(frame, KEY)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(xs_s: list[float]) -> dict[str, float]:
    us = [x * 1e6 for x in xs_s]
    return {
        "median_us": round(statistics.median(us), 1), "p99_us": round(pct(us, 0.99), 1),
        "min_us": round(min(us), 1), "n": len(us),
    }


def calibration() -> dict[str, float]:
    """How fast this machine is right now (other processes share its cores): compare runs by these."""
    a = np.ones(1000)
    ts = []
    for _ in range(2000):
        t0 = time.perf_counter()
        a + 1
        ts.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    sum(range(1_000_000))
    return {
        "small_numpy_op_us": round(statistics.median(ts) * 1e6, 2),
        "python_sum_1e6_ms": round((time.perf_counter() - t0) * 1e3, 1),
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }


def run_until_decoding(s: Scheduler) -> int:
    """Steps until every request decodes; returns the pages in the page tables."""
    while True:
        plan = s.plan_step()
        s.on_result(plan, fake_result(plan))
        st = s.stats()
        if int(plan.prepare.query_lens.max()) == 1 and st.waiting == st.preempted == 0:
            return int(plan.prepare.page_table_lens.sum())


def decode_case(n_seqs: int, num_kv_pages: int, steps: int, seed: int = 0, ctx: tuple[int, int] = (256, 768)) -> dict:
    rng = np.random.default_rng(seed)
    cfg = SchedulerConfig(
        num_kv_pages=num_kv_pages, page_size=PAGE, max_num_seqs=n_seqs, max_num_batched_tokens=max(8192, n_seqs),
        max_model_len=4096, enable_prefix_cache=True,
    )
    s = Scheduler(cfg)
    for rid in range(n_seqs):
        prompt = rng.integers(10, 30000, size=int(rng.integers(*ctx)), dtype=np.int32)
        s.add_request(rid, prompt, SamplingParams(max_tokens=2048, ignore_eos=True))
    pages = run_until_decoding(s)
    plan_t, result_t = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        plan = s.plan_step()
        encode_plan(plan, i)
        t1 = time.perf_counter()
        res = fake_result(plan)
        t2 = time.perf_counter()
        s.on_result(plan, res)
        t3 = time.perf_counter()
        plan_t.append(t1 - t0)
        result_t.append(t3 - t2)
    return {
        "seqs": n_seqs, "pool_pages": num_kv_pages, "pages_in_tables": pages,
        "plan_encode": summary(plan_t), "on_result": summary(result_t),
    }


def pipelined_case(n_seqs: int, steps: int, seed: int = 0) -> dict | None:
    """plan + encode of step N+1 while step N is in flight, then N's on_result."""
    if "max_inflight_steps" not in SchedulerConfig.__dataclass_fields__:
        return None
    rng = np.random.default_rng(seed)
    cfg = SchedulerConfig(
        num_kv_pages=65536, page_size=PAGE, max_num_seqs=n_seqs, max_num_batched_tokens=max(8192, n_seqs),
        max_model_len=4096, max_inflight_steps=2,
    )
    s = Scheduler(cfg)
    for rid in range(n_seqs):
        prompt = rng.integers(10, 30000, size=int(rng.integers(256, 768)), dtype=np.int32)
        s.add_request(rid, prompt, SamplingParams(max_tokens=2048, ignore_eos=True))
    pages = run_until_decoding(s)
    plan_t, result_t = [], []
    older = s.plan_step()
    for i in range(steps):
        t0 = time.perf_counter()
        plan = s.plan_step()
        if plan is None:  # the pool is full: the plan after this RESULT preempts
            s.on_result(older, fake_result(older))
            older = s.plan_step()
            continue
        encode_plan(plan, i)
        t1 = time.perf_counter()
        res = fake_result(older)
        t2 = time.perf_counter()
        s.on_result(older, res)
        t3 = time.perf_counter()
        plan_t.append(t1 - t0)
        result_t.append(t3 - t2)
        assert int(plan.prepare.feedback.sum()) == n_seqs
        older = plan
    return {"seqs": n_seqs, "pages_in_tables": pages, "plan_encode": summary(plan_t), "on_result": summary(result_t)}


def plan_only(n_seqs: int, steps: int) -> dict:
    """plan_step alone (no encode), for the split of the cost."""
    rng = np.random.default_rng(1)
    cfg = SchedulerConfig(num_kv_pages=65536, page_size=PAGE, max_num_seqs=n_seqs, max_num_batched_tokens=8192, max_model_len=4096)
    s = Scheduler(cfg)
    for rid in range(n_seqs):
        s.add_request(rid, rng.integers(10, 30000, size=512, dtype=np.int32), SamplingParams(max_tokens=2048, ignore_eos=True))
    run_until_decoding(s)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = s.plan_step()
        ts.append(time.perf_counter() - t0)
        s.on_result(plan, fake_result(plan))
    return summary(ts)


def prefix_case(n_req: int = 256, prefix_len: int = 1024, tail: int = 16, as_tuple: bool = False, repeats: int = 7) -> dict:
    """Median over `repeats` fresh schedulers (one sample is mostly noise on a shared machine).

    Prompts and SamplingParams are built before the clock starts: the frontend makes both. int32
    arrays are what the engine hands to add_request."""
    add_t, plan_t, enc_t = [], [], []
    for _ in range(repeats):
        cfg = SchedulerConfig(
            num_kv_pages=16384, page_size=PAGE, max_num_seqs=n_req + 1, max_num_batched_tokens=n_req * tail + 2048,
            max_model_len=4096,
        )
        s = Scheduler(cfg)
        rng = np.random.default_rng(2)
        prefix = rng.integers(10, 30000, size=prefix_len, dtype=np.int32)
        s.add_request(10_000, np.concatenate((prefix, [5])), SamplingParams(max_tokens=1))
        while s.has_work():
            plan = s.plan_step()
            s.on_result(plan, fake_result(plan))
        prompts = [np.concatenate((prefix, rng.integers(10, 30000, size=tail, dtype=np.int32))) for _ in range(n_req)]
        if as_tuple:
            prompts = [tuple(p.tolist()) for p in prompts]
        params = [SamplingParams(max_tokens=8) for _ in range(n_req)]
        t0 = time.perf_counter()
        for rid, (prompt, sp) in enumerate(zip(prompts, params)):
            s.add_request(rid, prompt, sp)
        t1 = time.perf_counter()
        plan = s.plan_step()
        t2 = time.perf_counter()
        encode_plan(plan, 1)
        t3 = time.perf_counter()
        add_t.append(t1 - t0)
        plan_t.append(t2 - t1)
        enc_t.append(t3 - t2)
    st = s.stats()
    med = statistics.median
    return {
        "requests": n_req, "prefix_tokens": prefix_len, "prompts_as": "tuple" if as_tuple else "numpy",
        "repeats": repeats, "add_request_total_ms": round(med(add_t) * 1e3, 3),
        "admit_step_plan_ms": round(med(plan_t) * 1e3, 3),
        "admission_total_ms": round(med([a + p for a, p in zip(add_t, plan_t)]) * 1e3, 3),
        "admission_total_min_ms": round(min(a + p for a, p in zip(add_t, plan_t)) * 1e3, 3),
        "encode_ms": round(med(enc_t) * 1e3, 3),
        "admitted": int(plan.prepare.seq_ids.shape[0]), "prefix_hit_pages": st.prefix_hit_pages_total,
        "new_tokens": int(plan.prepare.query_lens.sum()),
    }


def pressure_case(steps: int) -> dict:
    cfg = SchedulerConfig(
        num_kv_pages=2048, page_size=PAGE, max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=4096,
        num_host_pages=1024,
    )
    s = Scheduler(cfg)
    rng = np.random.default_rng(3)
    shared = rng.integers(10, 30000, size=256, dtype=np.int32)
    rid = 0

    def top_up() -> None:
        nonlocal rid
        while s.stats().waiting + s.stats().preempted < 64:
            tail = rng.integers(10, 30000, size=int(rng.integers(16, 256)), dtype=np.int32)
            prompt = np.concatenate((shared, tail)) if rid % 2 else tail
            s.add_request(rid, prompt, SamplingParams(max_tokens=int(rng.integers(32, 512)), ignore_eos=True))
            rid += 1

    ts = []
    for i in range(steps):
        top_up()
        t0 = time.perf_counter()
        plan = s.plan_step()
        encode_plan(plan, i)
        ts.append(time.perf_counter() - t0)
        s.on_result(plan, fake_result(plan))
    st = s.stats()
    return {
        "plan_encode": summary(ts), "steps": steps, "running_at_end": st.running,
        "preemptions": st.preemptions_total, "offloads": st.offloads_total, "restores": st.restores_total,
        "evictions": st.evictions_total, "finished": rid - st.running - st.waiting - st.preempted,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    ap.add_argument("--tree", help="the checkout whose scheduler to measure (default: this one)")
    args = ap.parse_args()
    steps = 60 if args.quick else 400
    reps = 3 if args.quick else 9
    out: dict = {"decode": [], "pool_size": [], "targets_us": {"decode_256": 150, "decode_1024": 600, "prefix_256_ms": 5}}
    for n in (64, 256, 1024):
        out["decode"].append(decode_case(n, 65536, steps))
    for pages in (16384, 262144):
        out["pool_size"].append(decode_case(256, pages, steps, seed=5, ctx=(128, 224)))
    out["plan_only_256"] = plan_only(256, steps)
    out["decode_pipelined"] = [r for r in (pipelined_case(n, steps) for n in (256, 1024)) if r is not None]
    out["prefix_sharing"] = [prefix_case(repeats=reps), prefix_case(as_tuple=True, repeats=reps)]
    out["pressure"] = pressure_case(steps // 2)
    out["calibration"] = calibration()
    out["tree"] = _tree()
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for row in out["decode"] + out["pool_size"]:
        pe, r = row["plan_encode"], row["on_result"]
        print(
            f"decode {row['seqs']:5d} seqs pool {row['pool_pages']:6d} pages ({row['pages_in_tables']} in tables): "
            f"plan+encode median {pe['median_us']:.0f} us p99 {pe['p99_us']:.0f} us min {pe['min_us']:.0f} us; "
            f"on_result median {r['median_us']:.0f} us"
        )
    print(f"plan_step alone, 256 seqs: median {out['plan_only_256']['median_us']:.0f} us")
    for row in out["decode_pipelined"]:
        pe, r = row["plan_encode"], row["on_result"]
        print(
            f"decode {row['seqs']:5d} seqs, next step planned while one is in flight: plan+encode median "
            f"{pe['median_us']:.0f} us p99 {pe['p99_us']:.0f} us; on_result median {r['median_us']:.0f} us"
        )
    for p in out["prefix_sharing"]:
        print(
            f"prefix sharing ({p['prompts_as']} prompts): {p['requests']} requests x {p['prefix_tokens']}-token prefix: "
            f"add_request {p['add_request_total_ms']:.2f} ms + admitting step {p['admit_step_plan_ms']:.2f} ms = "
            f"{p['admission_total_ms']:.2f} ms (median of {p['repeats']}, min {p['admission_total_min_ms']:.2f}; "
            f"{p['prefix_hit_pages']} pages shared)"
        )
    print(f"machine now: {out['calibration']}")
    pr = out["pressure"]
    print(
        f"pressure: plan+encode median {pr['plan_encode']['median_us']:.0f} us p99 {pr['plan_encode']['p99_us']:.0f} us; "
        f"{pr['preemptions']} preemptions, {pr['offloads']} offloads, {pr['restores']} restores, {pr['evictions']} evictions"
    )


if __name__ == "__main__":
    main()
