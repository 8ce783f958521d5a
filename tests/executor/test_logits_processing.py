"""Logits processing on rank 0 against a plain reference computation: logit bias, banned tokens, and
the repetition, frequency and presence penalties (vLLM's semantics and order) change crafted logits
exactly as element-by-element Python says; the sample, its logprob and its alternatives come from
the processed row; and the executor's held sampling state builds the processing from a PREPARE."""

from __future__ import annotations

import math

import numpy as np
import torch

from executor.sampler import LogitsProcessing, SamplingBatch, process_logits, sample
from executor.sampling_state import SamplingStates
from protocol.frames import Prepare, plain_sampling

VOCAB = 32
LONG = torch.long


def reference(row: list[float], *, bias=(), banned=(), prompt=(), output=(), presence=0.0, frequency=0.0, repetition=1.0):
    """One row, one token at a time, as the semantics are written down."""
    out = list(row)
    for token, value in bias:
        out[token] += value
    for token in banned:
        out[token] = -math.inf
    seen = set(prompt) | set(output)
    for token in range(len(out)):
        x = out[token]
        if token in seen:
            x = x / repetition if x > 0 else x * repetition
        count = output.count(token)
        x -= frequency * count
        x -= presence * (1 if count else 0)
        out[token] = x
    return out


def longs(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=LONG)


def processing(rows: dict[int, dict], penalized: list[int]) -> LogitsProcessing:
    """LogitsProcessing from a reference description: rows[r] holds the reference's keywords."""
    bias_rows, bias_ids, bias_values, banned_rows, banned_ids = [], [], [], [], []
    prompt_rows, prompt_ids, output_rows, output_ids = [], [], [], []
    for r, spec in rows.items():
        for token, value in spec.get("bias", ()):
            bias_rows.append(r), bias_ids.append(token), bias_values.append(value)
        for token in spec.get("banned", ()):
            banned_rows.append(r), banned_ids.append(token)
    for k, r in enumerate(penalized):
        for token in rows[r].get("prompt", ()):
            prompt_rows.append(k), prompt_ids.append(token)
        for token in rows[r].get("output", ()):
            output_rows.append(k), output_ids.append(token)
    return LogitsProcessing(
        bias_rows=longs(bias_rows), bias_ids=longs(bias_ids), bias_values=torch.tensor(bias_values, dtype=torch.float32),
        banned_rows=longs(banned_rows), banned_ids=longs(banned_ids), penalty_rows=longs(penalized),
        presence=torch.tensor([rows[r].get("presence", 0.0) for r in penalized], dtype=torch.float32),
        frequency=torch.tensor([rows[r].get("frequency", 0.0) for r in penalized], dtype=torch.float32),
        repetition=torch.tensor([rows[r].get("repetition", 1.0) for r in penalized], dtype=torch.float32),
        prompt_rows=longs(prompt_rows), prompt_ids=longs(prompt_ids), output_rows=longs(output_rows),
        output_ids=longs(output_ids),
    )


def crafted(rows: int, seed: int = 0) -> torch.Tensor:
    # Positive and negative logits, so that the repetition penalty's two branches both show.
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=g) * 4).float()


def plain_batch(rows: int, **extra) -> SamplingBatch:
    return SamplingBatch.of(np.zeros(rows), np.ones(rows), np.zeros(rows), np.full(rows, -1), np.arange(rows), **extra)


def test_every_processing_matches_the_reference_row_by_row():
    rng = np.random.default_rng(0)
    for trial in range(30):
        n = int(rng.integers(1, 6))
        logits = crafted(n, seed=trial)
        rows, penalized = {}, []
        for r in range(n):
            if rng.integers(0, 4) == 0:
                continue  # a row without processing stays as it was
            spec = {}
            if rng.integers(0, 2):
                ids = sorted(rng.choice(VOCAB, size=int(rng.integers(1, 6)), replace=False).tolist())
                spec["bias"] = [(t, float(rng.uniform(-100, 100))) for t in ids]
            if rng.integers(0, 3) == 0:
                spec["banned"] = sorted(rng.choice(VOCAB, size=2, replace=False).tolist())
            if rng.integers(0, 3):
                spec.update(
                    prompt=rng.integers(0, VOCAB, size=int(rng.integers(0, 12))).tolist(),
                    output=rng.integers(0, 8, size=int(rng.integers(0, 12))).tolist(),  # repeats: counts > 1
                    presence=float(rng.uniform(-2, 2)), frequency=float(rng.uniform(-2, 2)),
                    repetition=float(rng.choice([1.0, 1.5, 0.7, 2.0])),
                )
                penalized.append(r)
            rows[r] = spec
        got = process_logits(logits, processing(rows, penalized))
        for r in range(n):
            want = reference(logits[r].tolist(), **rows.get(r, {}))
            np.testing.assert_allclose(got[r].numpy(), np.array(want, dtype=np.float32), rtol=1e-6, atol=1e-5)


def test_processing_leaves_its_input_unchanged():
    logits = crafted(2)
    before = logits.clone()
    process_logits(logits, processing({0: {"bias": [(3, 5.0)], "banned": [4]}}, []))
    assert torch.equal(logits, before)


def test_the_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    row = [0.0] * VOCAB
    row[1], row[2], row[3], row[4] = 3.0, -3.0, 3.0, -3.0
    spec = {"prompt": [1], "output": [2], "repetition": 1.5}
    got = process_logits(torch.tensor([row]), processing({0: spec}, [0]))[0]
    assert got[1].item() == 2.0 and got[2].item() == -4.5  # seen in the prompt, in the output
    assert got[3].item() == 3.0 and got[4].item() == -3.0  # never seen: unchanged


def test_frequency_counts_and_presence_once_over_the_output_only():
    row = [1.0] * VOCAB
    spec = {"prompt": [9, 9], "output": [5, 5, 5, 6], "presence": 0.5, "frequency": 0.25}
    got = process_logits(torch.tensor([row]), processing({0: spec}, [0]))[0]
    assert got[5].item() == 1.0 - 0.75 - 0.5 and got[6].item() == 1.0 - 0.25 - 0.5
    assert got[9].item() == 1.0  # prompt tokens count only for the repetition penalty


def test_the_sample_its_logprob_and_alternatives_come_from_the_processed_row():
    logits = crafted(3, seed=7)
    rows = {
        0: {"bias": [(int(logits[0].argmin()), 100.0)]},  # the least likely token becomes the greedy pick
        1: {"output": [int(logits[1].argmax())] * 3, "frequency": 2.0, "presence": 2.0},
        2: {"banned": [int(logits[2].argmax())]},
    }
    proc = processing(rows, [1])
    k = np.array([3, 0, 5], dtype=np.uint8)
    temperature = torch.tensor([0.0, 0.0, 0.5])
    out = sample(logits, SamplingBatch.of(temperature, np.ones(3), [0, 0, 1], [-1, -1, 11], range(3), processing=proc, num_logprobs=k))
    for r in range(3):
        want = torch.tensor(reference(logits[r].tolist(), **rows[r]))
        scaled = want / (temperature[r] if temperature[r] > 0 else 1.0)
        log_probs = torch.log_softmax(scaled, dim=-1)
        token = int(want.argmax())  # top_k 1 on row 2: the processed argmax there too
        assert out.token_ids[r].item() == token
        torch.testing.assert_close(out.logprobs[r], log_probs[token])
        values, ids = log_probs.topk(int(k.max()))
        wanted = int(k[r])
        assert out.top_ids[r, :wanted].tolist() == ids[:wanted].tolist()
        torch.testing.assert_close(out.top_logprobs[r, :wanted], values[:wanted])
    assert out.token_ids[0].item() == int(logits[0].argmin())
    assert out.token_ids[2].item() != int(logits[2].argmax())


def test_rows_without_processing_sample_exactly_as_before():
    logits = crafted(4, seed=3)
    batch = dict(temperature=[0.0, 0.9, 0.0, 1.2], top_p=[1.0, 0.8, 1.0, 1.0], top_k=[0, 0, 0, 0], seeds=[-1, 5, -1, 9], positions=range(4))
    plain = sample(logits, SamplingBatch.of(**batch))
    processed = sample(logits, SamplingBatch.of(**batch, processing=processing({2: {"bias": [(0, 50.0)]}}, [])))
    for r in (0, 1, 3):
        assert processed.token_ids[r] == plain.token_ids[r]
        assert processed.logprobs[r].item() == plain.logprobs[r].item()
    assert processed.token_ids[2].item() == 0


def test_nothing_samplable_is_not_finite_and_neither_is_a_penalty_overflow():
    logits = crafted(3)
    logits[2, 4] = 3.3e38
    proc = processing({0: {"banned": list(range(VOCAB))}, 2: {"prompt": [4], "repetition": 1e-5}}, [2])
    out = sample(logits, plain_batch(3, processing=proc))
    assert out.finite.tolist() == [False, True, False]
    assert math.isnan(out.logprobs[0].item()) and math.isnan(out.logprobs[2].item())


def test_banned_tokens_are_never_drawn_at_any_temperature():
    logits = torch.zeros(64, VOCAB)
    logits[:, :4] = 10.0  # nearly all the mass on 0..3
    proc = processing({r: {"banned": [0, 1, 2, 3]} for r in range(64)}, [])
    out = sample(logits, SamplingBatch.of(np.full(64, 1.5), np.ones(64), np.zeros(64), np.arange(64), np.zeros(64), processing=proc))
    assert bool(out.finite.all()) and int(out.token_ids.min()) >= 4


def prepare_with_state(**arrays) -> Prepare:
    """Two sampled sequences (7 and 8) of one token each; the arrays given replace the defaults."""
    n = 2
    fields = dict(
        seq_ids=np.array([7, 8], dtype=np.int64), query_lens=np.ones(n, dtype=np.int32),
        context_lens=np.array([5, 9], dtype=np.int32), token_ids=np.array([3, 4], dtype=np.int32),
        positions=np.array([4, 8], dtype=np.int32), page_table_lens=np.ones(n, dtype=np.int32),
        page_table_base=np.zeros(n, dtype=np.int32), page_table=np.array([1, 2], dtype=np.int32),
        sample=np.ones(n, dtype=np.uint8), temperature=np.zeros(n, dtype=np.float32),
        top_p=np.ones(n, dtype=np.float32), top_k=np.zeros(n, dtype=np.int32), seeds=np.full(n, -1, dtype=np.int64),
        cleared_pages=np.zeros(0, dtype=np.int32), restore_pages=np.zeros(0, dtype=np.int32),
        restore_slots=np.zeros(0, dtype=np.int32), offload_pages=np.zeros(0, dtype=np.int32),
        offload_slots=np.zeros(0, dtype=np.int32), poison_pages=np.zeros(0, dtype=np.int32),
        feedback=np.zeros(n, dtype=np.uint8), **plain_sampling(n),
    )
    fields.update(arrays)
    return Prepare(**fields)


def test_held_states_build_the_processing_the_reference_computes():
    """Sequence 7: repetition and frequency over a prompt and an output sent whole; sequence 8: a
    logit bias and banned stop tokens. The next step holds them and adds the sampled tokens."""
    states = SamplingStates()
    first = prepare_with_state(
        repetition_penalty=np.array([1.5, 1.0], dtype=np.float32), frequency_penalty=np.array([0.5, 0.0], dtype=np.float32),
        sampling_state=np.array([1, 1], dtype=np.uint8), history_lens=np.array([5, 0], dtype=np.int32),
        history_prompt_lens=np.array([3, 0], dtype=np.int32), history=np.array([1, 2, 3, 9, 9], dtype=np.int32),
        logit_bias_lens=np.array([0, 2], dtype=np.int32), logit_bias_ids=np.array([5, 6], dtype=np.int32),
        logit_bias=np.array([3.0, -2.0], dtype=np.float32), banned_lens=np.array([0, 1], dtype=np.int32),
        banned_ids=np.array([0], dtype=np.int32),
    )
    logits = crafted(2, seed=5)
    states.begin(first, {})
    proc = states.processing(first, "cpu")
    got = process_logits(logits, proc)
    np.testing.assert_allclose(got[0].numpy(), reference(logits[0].tolist(), prompt=[1, 2, 3], output=[9, 9],
                                                         frequency=0.5, repetition=1.5), rtol=1e-6)
    np.testing.assert_allclose(got[1].numpy(), reference(logits[1].tolist(), bias=[(5, 3.0), (6, -2.0)], banned=[0]), rtol=1e-6)
    states.append(first.seq_ids, np.array([9, 11]), np.array([1, 1]))

    # Held: nothing travels but the per-step fields; sequence 7 now has output 9, 9, 9.
    second = prepare_with_state(
        repetition_penalty=np.array([1.5, 1.0], dtype=np.float32), frequency_penalty=np.array([0.5, 0.0], dtype=np.float32),
        sampling_state=np.array([2, 2], dtype=np.uint8),
    )
    states.begin(second, {})
    got = process_logits(logits, states.processing(second, "cpu"))
    np.testing.assert_allclose(got[0].numpy(), reference(logits[0].tolist(), prompt=[1, 2, 3], output=[9, 9, 9],
                                                         frequency=0.5, repetition=1.5), rtol=1e-6)
    np.testing.assert_allclose(got[1].numpy(), reference(logits[1].tolist(), bias=[(5, 3.0), (6, -2.0)]), rtol=1e-6)
    assert states.output_of(7) == [9, 9, 9] and states.output_of(8) == [11]

    # Sequence 8 absent from a step is forgotten; 7 is sent whole again (as after a preemption),
    # with a fed-back token the scheduler could not know yet.
    third = prepare_with_state(
        seq_ids=np.array([7, 9], dtype=np.int64), frequency_penalty=np.array([0.5, 0.0], dtype=np.float32),
        sampling_state=np.array([1, 0], dtype=np.uint8), history_lens=np.array([2, 0], dtype=np.int32),
        history=np.array([9, 9], dtype=np.int32), feedback=np.array([1, 0], dtype=np.uint8),
    )
    states.begin(third, {0: 4})
    assert len(states) == 1 and states.output_of(7) == [9, 9, 4]
    got = process_logits(logits, states.processing(third, "cpu"))
    np.testing.assert_allclose(got[0].numpy(), reference(logits[0].tolist(), output=[9, 9, 4], frequency=0.5), rtol=1e-6)
    assert torch.equal(got[1], logits[1])


def test_a_step_without_processing_builds_none():
    states = SamplingStates()
    p = prepare_with_state()
    states.begin(p, {})
    assert states.processing(p, "cpu") is None and len(states) == 0
