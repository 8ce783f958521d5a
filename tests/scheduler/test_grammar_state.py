"""A request's output grammar travels with its sampling state: whole, with the output known so far,
on its first step and again whenever the executors forgot it (a preemption by recompute), and not
at the steps between; min_p rides every step."""

from __future__ import annotations

import numpy as np

from protocol.grammar import GrammarKind, GrammarSpec
from scheduler import SamplingParams
from tests.scheduler.test_pipelined import make, pipelined_loop

SPEC = GrammarSpec(GrammarKind.REGEX, "[a-z]+")


def test_the_grammar_is_sent_whole_again_after_a_preemption_by_recompute():
    d = make(seeded=True, num_kv_pages=5, page_size=2, max_num_seqs=2, max_num_batched_tokens=8)
    d.add(0, [5, 6], SamplingParams(max_tokens=7, seed=1))
    # The later request is the one preempted.
    d.add(1, [7, 8], SamplingParams(max_tokens=7, seed=2, grammar=SPEC, min_p=0.5))
    sent = []

    def on_plan(d, plan):
        p = plan.prepare
        i = np.flatnonzero(p.seq_ids == 1)
        if not i.shape[0]:
            return
        i = int(i[0])
        assert p.min_p[i] == np.float32(0.5)
        grammar_end = int(p.grammar_lens[: i + 1].sum())
        grammar = bytes(p.grammar[grammar_end - int(p.grammar_lens[i]) : grammar_end])
        if p.sampling_state[i] == 1:
            end = int(p.history_lens[: i + 1].sum())
            output = p.history[end - int(p.history_lens[i]) + int(p.history_prompt_lens[i]) : end].tolist()
            sent.append((grammar, output, list(d.emitted[1])))
        else:
            assert p.sampling_state[i] == 2 and grammar == b""

    pipelined_loop(d, on_plan)
    d.check_outputs()
    assert d.s.stats().preemptions_total > 0
    assert len(sent) >= 2, "sent once at the start and again after the preemption"
    for grammar, output, emitted in sent:
        assert GrammarSpec.decode(grammar) == SPEC
        assert output == emitted[: len(output)]
    assert sent[0][1] == [] and sent[-1][1], "the state sent again carries the output so far"
