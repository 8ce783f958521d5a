"""Seeded operation sequences driven through the scheduler's public API, and a digest of every PREPARE.

The digests in data/serial_prepares.json were recorded from the scheduler as it was before the
split and the pipelining (commit afdec79):

    PYTHONPATH=<a checkout of afdec79> python tests/scheduler/serial_scenarios.py --record \\
        tests/scheduler/data/serial_prepares.json

test_serial_identity.py replays the same sequences against today's scheduler (one step in flight)
and requires every PREPARE to be byte-identical, and every request's tokens and ending to be the
same. This module imports only names that scheduler had, so that the recording runs there too.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys

import numpy as np

from protocol import frames
from protocol.frames import Result
from scheduler import AdmissionError, SamplingParams, Scheduler, SchedulerConfig

SHARED = [[], [7, 8, 9, 10, 11, 12, 13, 14, 15], [5] * 20, list(range(40, 73))]
VOCAB = 60
EOS = 2


def config_for(rng: np.random.Generator, big: bool) -> SchedulerConfig:
    if big:
        return SchedulerConfig(
            num_kv_pages=int(rng.integers(160, 400)), page_size=16, max_num_seqs=64, max_num_batched_tokens=512,
            max_model_len=256, eos_token_ids=(EOS,), num_host_pages=int(rng.choice([0, 64, 256])),
            enable_prefix_cache=bool(rng.integers(0, 4)), poison_freed_pages=bool(rng.integers(0, 2)),
            decode_lookahead=int(rng.integers(0, 3)),
        )
    seqs = int(rng.integers(1, 7))
    return SchedulerConfig(
        num_kv_pages=int(rng.integers(8, 40)), page_size=int(rng.choice([2, 4, 8])), max_num_seqs=seqs,
        max_num_batched_tokens=seqs + int(rng.integers(0, 24)), max_model_len=64, eos_token_ids=(EOS,),
        num_host_pages=int(rng.choice([0, 4, 16, 64])), enable_prefix_cache=bool(rng.integers(0, 4)),
        poison_freed_pages=bool(rng.integers(0, 2)), decode_lookahead=int(rng.integers(0, 3)),
    )


def digest(plan) -> str:
    """The PREPARE's fields as afdec79 had them. The logits-processing fields came later; no scenario
    uses them, so each must hold its plain value (frames.plain_sampling, absent at afdec79) and stays
    out of the digest, which keeps the recording's anchor. So does decode_steps, 1 in every scenario
    (one forward per step, as then)."""
    plain = getattr(frames, "plain_sampling", lambda n: {})(plan.prepare.seq_ids.shape[0])
    h = hashlib.sha256(str(plan.step).encode())
    for f in dataclasses.fields(plan.prepare):
        if f.name == "decode_steps":
            assert plan.prepare.decode_steps == 1, "a serial scenario ran several forwards on one frame"
            continue
        a = np.ascontiguousarray(getattr(plan.prepare, f.name))
        if f.name in plain:
            assert a.dtype == plain[f.name].dtype and np.array_equal(a, plain[f.name]), f"{f.name} is not plain"
            continue
        h.update(f"{f.name}:{a.dtype.str}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:8]


class Run:
    """One scenario: the scheduler, what it emitted per request, and the PREPARE digests."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.big = seed % 5 == 4
        self.cfg = config_for(self.rng, self.big)
        self.s = Scheduler(self.cfg)
        self.digests: list[str] = []
        self.emitted: dict[int, list] = {}
        self.next_id = 0
        self.inflight = None
        self.client_ended: set[int] = set()

    def take(self, outputs) -> None:
        for o in outputs:
            entry = self.emitted.setdefault(o.request_id, [])
            entry.extend(o.token_ids)
            if o.finished:
                entry.append((o.finish_reason, o.error))

    def add(self) -> None:
        rng = self.rng
        head = SHARED[int(rng.integers(0, len(SHARED)))]
        tail = rng.integers(3, VOCAB, size=int(rng.integers(0, 30 if self.big else 12))).tolist()
        prompt = (head + tail) or [4]
        params = SamplingParams(
            max_tokens=int(rng.integers(1, 40 if self.big else 16)),
            temperature=float(rng.choice([0.0, 0.7])),
            top_p=float(rng.choice([1.0, 0.9])),
            top_k=int(rng.choice([0, 5])),
            seed=None if rng.integers(0, 2) else int(rng.integers(0, 1000)),
            stop_token_ids=((5,) if rng.integers(0, 4) == 0 else ()),
            ignore_eos=bool(rng.integers(0, 3) == 0),
        )
        try:
            self.s.add_request(self.next_id, np.array(prompt, dtype=np.int32) if rng.integers(0, 2) else prompt, params)
            self.emitted[self.next_id] = []
        except AdmissionError:
            pass
        self.next_id += 1

    def plan(self) -> None:
        plan = self.s.plan_step()
        self.take(self.s.drain_outputs())
        self.digests.append("-" if plan is None else digest(plan))
        self.inflight = plan

    def result(self, bad: bool = False, mismatch: bool = False) -> Result:
        p = self.inflight.prepare
        idx = np.flatnonzero(p.sample)
        n = idx.shape[0]
        ids = p.seq_ids[idx].astype(np.int64)
        if mismatch:
            ids = ids[::-1] + 1 if n > 1 else ids + 1000
        finite = np.ones(n, dtype=np.uint8)
        if bad and n:
            finite[int(self.rng.integers(0, n))] = 0
        return Result(
            seq_ids=ids, token_ids=self.rng.integers(0, VOCAB, size=n).astype(np.int32),
            logprobs=np.full(n, -0.5, dtype=np.float32), finite=finite,
        )

    def finish_step(self) -> None:
        plan, self.inflight = self.inflight, None
        kind = int(self.rng.integers(0, 40))
        if kind == 0:
            self.take(self.s.on_abort(plan, "rank 1 rejected the frame"))
        else:
            self.inflight = plan
            res = self.result(bad=kind == 1, mismatch=kind == 2)
            self.inflight = None
            self.take(self.s.on_result(plan, res))

    def end_one(self) -> None:
        if not self.next_id:
            return
        rid = int(self.rng.integers(0, self.next_id))
        self.client_ended.add(rid)
        (self.s.cancel if self.rng.integers(0, 2) else self.s.finish)(rid)
        self.take(self.s.drain_outputs())

    def walk(self, ops: int) -> None:
        for _ in range(ops):
            r = int(self.rng.integers(0, 20))
            if r < 4:
                for _ in range(int(self.rng.integers(1, 8 if self.big else 4))):
                    self.add()
            elif r == 4:
                self.end_one()
            elif self.inflight is None:
                self.plan()
            else:
                self.finish_step()
        if self.inflight is not None:
            self.finish_step()
        for _ in range(5000):
            if not self.s.has_work():
                break
            self.plan()
            if self.inflight is not None:
                self.finish_step()
        self.take(self.s.drain_outputs())

    def transcript(self) -> str:
        """Every request's tokens and how it ended. For a request the client cancelled or finished,
        the tokens only: the pipelined scheduler reports that ending at once, where the old one
        waited for the step in flight and, if that step was then aborted, reported the abort."""
        ends = {
            k: [list(x) for x in v if isinstance(x, tuple) and k not in self.client_ended] + [x for x in v if not isinstance(x, tuple)]
            for k, v in self.emitted.items()
        }
        text = json.dumps(sorted(ends.items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


SEEDS = range(60)


def run(seed: int) -> dict:
    r = Run(seed)
    r.walk(400 if r.big else 150)
    return {"seed": seed, "steps": " ".join(r.digests), "transcript": r.transcript()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", required=True, help="write the digests of every scenario to this JSON file")
    args = ap.parse_args()
    out = [run(seed) for seed in SEEDS]
    with open(args.record, "w") as f:
        json.dump(out, f, indent=0)
        f.write("\n")
    print(f"{len(out)} scenarios, {sum(len(o['steps'].split()) for o in out)} plans", file=sys.stderr)


if __name__ == "__main__":
    main()
