"""The scheduler's sampling states through the executors' own bookkeeping (executor.sampling_state),
over seeded random walks with up to two steps in flight, pressure (preemption by recompute and by
offload), prefix hits, n samples sharing a prompt, aborts and client ends.

At every step that runs, each sampled sequence with a penalty must find, held on rank 0, exactly its
prompt (when the repetition penalty counts it) and every token it generated so far, feedback-resolved
ones included, whether the state was sent whole at that step or held across steps; its logit bias;
and, while it is short of min_tokens, exactly its stop tokens banned. The link's rule
(SAMPLING_STATE_NOT_HELD) must never refuse what the scheduler sends."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from executor.sampling_state import SamplingStates, StatefulSequences, touches_states
from protocol.errors import ProtocolError, RejectCode
from scheduler import AdmissionError, SamplingParams, Scheduler
from tests.scheduler.random_walk import PREFIXES, VOCAB, config
from tests.scheduler.sched_sim import Driver, ShadowViolation


class StateDriver(Driver):
    """The shadow executors, plus rank 0's sampling states and the link's check on every PREPARE."""

    def __init__(self, s: Scheduler, seed: int) -> None:
        super().__init__(s, vocab=VOCAB, seed=seed)
        self.link = StatefulSequences()
        self.states = SamplingStates()
        self.params: dict[int, SamplingParams] = {}
        self.seen: Counter[str] = Counter()

    def add(self, rid, prompt, params, **kw) -> None:
        super().add(rid, prompt, params, **kw)
        self.params[rid] = params

    def plan(self):
        plan = super().plan()
        if plan is not None:
            self.link.accept(plan.prepare)  # raises SAMPLING_STATE_NOT_HELD if the scheduler got it wrong
        return plan

    def abort(self, *args, **kwargs):
        self.link.drop()
        return super().abort(*args, **kwargs)

    def run_next(self) -> None:
        f = next(f for f in self.inflight if not f.ran)
        p = f.plan.prepare
        fed_rows = np.flatnonzero(p.feedback).tolist()
        fed = {i: self.shadow.last_samples[int(p.seq_ids[i])] for i in fed_rows}
        if touches_states(p):  # as the runner does, with the link's decision
            self.states.begin(p, fed)
        else:
            self.states.forget()
        held, kept = set(self.states._held), {int(s) for s in p.seq_ids[p.sampling_state != 0]}
        if held != kept:  # a state no step keeps is not held on (what it held is freed)
            raise ShadowViolation(f"rank 0 holds the states of {sorted(held)} at a step that keeps {sorted(kept)}")
        super().run_next()

    def run_forward(self, p, table, forward):
        """Each forward of a step samples against the states the forwards before it extended."""
        self._check(p)
        self._avoid_banned(p)
        result = super().run_forward(p, table, forward)
        self.states.append(result.seq_ids, result.token_ids, result.finite)
        return result

    def _check(self, p) -> None:
        sampled = np.flatnonzero(p.sample).tolist()
        processing = self.states.processing(p, "cpu")
        if processing is not None and not touches_states(p):
            raise ShadowViolation(f"a step that touches no sampling state has logits processing: {processing}")
        banned_of: dict[int, list[int]] = {}
        if processing is not None:
            for row, token in zip(processing.banned_rows.tolist(), processing.banned_ids.tolist()):
                banned_of.setdefault(sampled[row], []).append(token)
        for i in sampled:
            rid = int(p.seq_ids[i])
            params = self.params[rid]
            tokens = self.shadow.tokens[rid]  # prompt + every token sampled so far
            prompt_len = self.prompt_len[rid]
            generated = len(tokens) - prompt_len
            if params.stateful:
                state = self.states._held[rid]
                if params.penalized and state.output.tolist() != tokens[prompt_len:]:
                    raise ShadowViolation(f"request {rid}: rank 0 holds output {state.output.tolist()}, it is {tokens[prompt_len:]}")
                want_prompt = tokens[:prompt_len] if params.repetition_penalty != 1 else []
                if state.prompt.tolist() != want_prompt:
                    raise ShadowViolation(f"request {rid}: rank 0 holds prompt {state.prompt.tolist()}")
                if state.bias_ids.tolist() != [t for t, _ in params.logit_bias]:
                    raise ShadowViolation(f"request {rid}: rank 0 holds logit bias ids {state.bias_ids.tolist()}")
                self.seen["sent whole" if p.sampling_state[i] == 1 else "held"] += 1
                if p.sampling_state[i] == 1 and p.feedback[i]:
                    self.seen["sent whole with a fed-back token"] += 1
                if p.sampling_state[i] == 1 and generated:
                    self.seen["sent whole with output so far"] += 1
            elif p.sampling_state[i] != 0:
                raise ShadowViolation(f"request {rid} uses no state but has sampling_state {p.sampling_state[i]}")
            stops = sorted(self.stops[rid])
            want_banned = stops if generated < params.min_tokens else []
            if sorted(banned_of.get(i, [])) != want_banned:
                raise ShadowViolation(f"request {rid}: {banned_of.get(i)} banned at output {generated}, want {want_banned}")
            if want_banned:
                self.seen["stop tokens banned"] += 1

    def _avoid_banned(self, p) -> None:
        """The shadow's random tokens must respect the bans, as the sampler does."""
        starts = np.cumsum(p.banned_lens) - p.banned_lens
        for i in np.flatnonzero(p.banned_lens).tolist():
            banned = set(p.banned_ids[starts[i] : starts[i] + p.banned_lens[i]].tolist())
            token = int(self.rng.integers(0, VOCAB))
            while token in banned:
                token = (token + 1) % VOCAB
            self.forced[int(p.seq_ids[i])] = token

    def check_min_tokens(self) -> None:
        for rid, out in self.emitted.items():
            early = out[: self.params[rid].min_tokens]
            if any(t in self.stops[rid] for t in early):
                raise ShadowViolation(f"request {rid} generated a stop token before min_tokens: {out}")


def random_params(rng: np.random.Generator) -> SamplingParams:
    max_tokens = int(rng.integers(1, 13))
    kind = int(rng.integers(0, 6))
    return SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=bool(rng.integers(0, 2)),
        stop_token_ids=(5,) if rng.integers(0, 2) else (),
        presence_penalty=0.5 if kind in (1, 4) else 0.0,
        frequency_penalty=-0.25 if kind == 2 else 0.0,
        repetition_penalty=1.3 if kind in (3, 4) else 1.0,
        logit_bias=((4, 2.0), (9, -1.0)) if kind in (4, 5) else (),
        min_tokens=int(rng.integers(0, max_tokens + 1)) if rng.integers(0, 2) else 0,
    )


def walk(seed: int, ops: int = 150) -> Counter[str]:
    rng = np.random.default_rng(seed)
    d = StateDriver(Scheduler(config(rng)), seed)
    next_id = 0
    for _ in range(ops):
        r = int(rng.integers(0, 12))
        if r < 2:
            samples = bool(rng.integers(0, 3) == 0)
            first, prompt, params = next_id, None, random_params(rng)
            for k in range(int(rng.integers(1, 4))):
                if not (samples and prompt):
                    prompt = (PREFIXES[int(rng.integers(0, 4))] + rng.integers(3, VOCAB, size=int(rng.integers(0, 10))).tolist()) or [4]
                    params = random_params(rng)
                try:
                    d.add(next_id, prompt, params, prompt_leader=first if samples and k else None)
                except AdmissionError:
                    pass
                next_id += 1
        elif r < 5 and d.can_plan:
            before = d.s.stats()
            d.plan()
            if d.s.stats().preemptions_total > before.preemptions_total:
                d.seen["preempted"] += 1
        elif r < 6 and len(d.inflight) > 1 and not d.inflight[0].ran:
            d.run_next()
        elif r < 9 and d.inflight:
            d.complete()
        elif r < 10 and d.inflight and not d.inflight[-1].ran:
            ids = d.inflight[-1].plan.prepare.seq_ids.tolist()
            d.abort(failed=None if rng.integers(0, 2) else [i for i in ids if rng.integers(0, 2)])
            d.seen["aborted"] += 1
        elif r < 11 and next_id:
            rid = int(rng.integers(0, next_id))
            (d.s.cancel if rng.integers(0, 2) else d.s.finish)(rid)
            d.take(d.s.drain_outputs())
    while d.inflight:
        d.complete()
    d.run_to_end()
    d.check_outputs()
    d.check_min_tokens()
    return d.seen


def test_sampling_states_follow_the_sequences_through_every_walk():
    seen: Counter[str] = Counter()
    for seed in range(40):
        seen += walk(seed)
    # A walk that never reached these would prove less than it claims.
    for case in (
        "sent whole", "held", "sent whole with a fed-back token", "sent whole with output so far",
        "stop tokens banned", "preempted", "aborted",
    ):
        assert seen[case] > 0, (case, seen)


def test_the_walk_catches_a_state_not_resent_after_an_abort_or_a_preemption():
    """A scheduler that sends a request's state whole only the first time (not after an ABORT, a
    preemption or a step it was absent from) is refused by the link."""
    import scheduler.plan as plan_module

    original = plan_module._processed
    sent_once: set[int] = set()

    def forgetful(batch, rows, base, sample):
        out = original(batch, rows, base, sample)
        state = out["sampling_state"].copy()
        for i, r in enumerate(rows.tolist()):
            rid = batch.reqs[r].request_id
            if state[i] == 1 and rid in sent_once:
                state[i] = 2
            elif state[i] == 1:
                sent_once.add(rid)
        out["sampling_state"] = state
        return out

    plan_module._processed = forgetful
    try:
        with pytest.raises(ProtocolError) as caught:
            for seed in range(40):
                walk(seed)
    finally:
        plan_module._processed = original
    assert caught.value.code == RejectCode.SAMPLING_STATE_NOT_HELD
