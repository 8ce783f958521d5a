import math
from dataclasses import fields, replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor.sampler import HostOutputs, HostRows, LogitsProcessing, SamplingBatch, SamplingError, argmax_rows, draw_unseeded, row_seed, sample


def batch(rows, temperature=0.0, top_p=1.0, top_k=0, seeds=-1, positions=None):
    def col(value):
        return list(value) if isinstance(value, (list, tuple)) else [value] * rows

    positions = list(range(rows)) if positions is None else positions
    return SamplingBatch.of(col(temperature), col(top_p), col(top_k), col(seeds), col(positions))


def min_p_only(rows, min_p):
    """Logits processing that is min_p on `rows` and nothing else."""
    empty = torch.zeros(0, dtype=torch.long)
    return LogitsProcessing(
        bias_rows=empty, bias_ids=empty, bias_values=torch.zeros(0), banned_rows=empty, banned_ids=empty,
        penalty_rows=empty, presence=torch.zeros(0), frequency=torch.zeros(0), repetition=torch.zeros(0),
        prompt_rows=empty, prompt_ids=empty, output_rows=empty, output_ids=empty,
        min_p_rows=torch.tensor(rows), min_p=torch.tensor(min_p, dtype=torch.float32),
    )  # fmt: skip


def random_logits(rows, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def test_greedy_is_argmax_with_log_softmax_logprob():
    logits = random_logits(5)
    out = sample(logits, batch(5))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    expected = torch.log_softmax(logits, dim=-1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)
    assert bool(out.finite.all())


def test_the_cpu_argmax_is_torchs_first_largest_column():
    logits = random_logits(7, vocab=49152)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [-1.0, -5.0, -1.0, -1.0]])
    assert argmax_rows(ties).tolist() == ties.argmax(dim=-1).tolist() == [1, 0, 0]
    strided = random_logits(6, vocab=64)[::2, 1::3]
    assert torch.equal(argmax_rows(strided), strided.argmax(dim=-1))
    assert argmax_rows(torch.zeros(0, 64)).dtype == torch.int64 and argmax_rows(torch.zeros(0, 64)).shape == (0,)
    # Off the CPU (a GPU's logits) it is torch's own argmax: a meta tensor takes that branch here.
    on_device = argmax_rows(torch.empty(3, 64, device="meta"))
    assert on_device.device.type == "meta" and on_device.shape == (3,) and on_device.dtype == torch.int64


def test_non_finite_rows_are_flagged_and_do_not_touch_other_rows():
    logits = random_logits(4)
    logits[1, 7] = float("nan")
    logits[3, 0] = float("inf")
    out = sample(logits, batch(4, temperature=[0.0, 0.0, 0.8, 0.8], seeds=5))
    assert out.finite.tolist() == [True, False, True, False]
    assert out.token_ids[1].item() == 0 and out.token_ids[3].item() == 0
    assert math.isnan(out.logprobs[1].item()) and math.isnan(out.logprobs[3].item())
    assert out.token_ids[0].item() == logits[0].argmax().item()
    assert math.isfinite(out.logprobs[2].item())


def test_a_finite_row_whose_sum_overflows_is_still_finite():
    logits = torch.full((2, 8), 3e38)
    logits[0, 5] = 3.3e38
    logits[1, 2] = float("-inf")
    out = sample(logits, batch(2))
    assert out.finite.tolist() == [True, False]
    assert out.token_ids.tolist() == [5, 0]


def test_a_finite_row_that_the_temperature_overflows_is_flagged_not_sampled():
    # Logits of 1e34 are finite, but divided by the lowest temperature (1e-5) they overflow float32
    # and the row's log_softmax is NaN: nothing can be sampled from it, on either path, whatever
    # the row's draw (plain, top-p, top-k over a vocabulary of block sums, or not).
    from executor.sampler import _sample_on_device, _sample_on_host

    for vocab in (64, 4096):
        logits = random_logits(5, vocab=vocab)
        logits[1:4, 3] = 1e34
        logits[4, 3] = 1e34  # greedy: not scaled, so it samples
        params = batch(5, temperature=[0.7, 1e-5, 1e-5, 1e-5, 0.0], top_p=[1.0, 1.0, 0.9, 1.0, 1.0], top_k=[0, 0, 0, 5, 0], seeds=3)
        for path in (sample, _sample_on_host, _sample_on_device):
            out = path(logits.clone(), params)
            assert out.finite.tolist() == [True, False, False, False, True], (vocab, path.__name__)
            assert out.token_ids[1:4].tolist() == [0, 0, 0] and out.token_ids[4].item() == 3
            assert out.logprobs[1:4].isnan().all() and math.isfinite(out.logprobs[0].item())


def test_seeded_row_is_independent_of_batch_composition():
    target = random_logits(1, seed=3)
    alone = sample(target, batch(1, temperature=1.0, seeds=1234, positions=[17]))
    others = random_logits(6, seed=4)
    mixed_logits = torch.cat([others[:4], target, others[4:]])
    mixed = sample(
        mixed_logits,
        batch(
            6 + 1,
            temperature=[0.7, 1.0, 0.0, 1.3, 1.0, 0.5, 0.9],
            top_k=[0, 5, 0, 0, 0, 3, 0],
            seeds=[-1, 9, -1, 77, 1234, -1, 8],
            positions=[3, 4, 5, 6, 17, 2, 1],
        ),
    )
    assert mixed.token_ids[4].item() == alone.token_ids[0].item()
    torch.testing.assert_close(mixed.logprobs[4], alone.logprobs[0])


def test_seeded_sampling_varies_with_position_and_seed():
    flat = torch.zeros(1, 1000)  # uniform: every draw is equally likely
    tokens = {
        sample(flat, batch(1, temperature=1.0, seeds=s, positions=[p])).token_ids.item()
        for s in (1, 2, 3)
        for p in range(10)
    }
    assert len(tokens) > 20  # 30 draws from 1000 tokens: collisions are rare, repeats would be a bug
    assert row_seed(1, 2) != row_seed(2, 1)


def test_top_k_one_is_greedy_and_top_k_bounds_the_support():
    logits = random_logits(200, vocab=50, seed=7)
    one = sample(logits, batch(200, temperature=2.0, top_k=1))
    assert torch.equal(one.token_ids, logits.argmax(dim=-1))
    out = sample(logits, batch(200, temperature=5.0, top_k=4))
    top4 = logits.topk(4, dim=-1).indices
    assert bool((top4 == out.token_ids[:, None]).any(dim=-1).all())


def test_top_p_keeps_the_nucleus_only():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(2000, 1)
    out = sample(logits, batch(2000, temperature=1.0, top_p=0.7))
    # mass before token 1 is 0.5 < 0.7 (kept), before token 2 is 0.8 > 0.7 (dropped)
    assert set(out.token_ids.tolist()) == {0, 1}


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    rows = 6000
    out = sample(probs.log().repeat(rows, 1), batch(rows, temperature=1.0))
    freq = torch.bincount(out.token_ids, minlength=3).float() / rows
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)
    hot = sample(probs.log().repeat(rows, 1), batch(rows, temperature=100.0))
    hot_freq = torch.bincount(hot.token_ids, minlength=3).float() / rows
    assert hot_freq.min().item() > 0.28  # near uniform at a high temperature
    expected = torch.log_softmax(probs.log() / 100.0, dim=-1)[hot.token_ids]
    torch.testing.assert_close(hot.logprobs, expected)


def test_mismatched_parameters_are_refused():
    with pytest.raises(SamplingError, match="temperature has shape"):
        sample(random_logits(3), batch(2))


def test_uniforms_drawn_ahead_must_fit_the_random_rows():
    params = batch(3, temperature=[0.5, 0.0, 1.0])
    assert replace(params, unseeded=np.zeros((2, 2), dtype=np.float32)).uniforms().shape == (2,)
    for bad in (np.zeros((1, 3), np.float32), np.zeros((0, 2), np.float32), np.zeros(2, np.float32), np.zeros((1, 2), np.float64)):
        with pytest.raises(SamplingError, match="unseeded uniforms"):
            replace(params, unseeded=bad)


def test_draws_ahead_are_the_draws_one_forward_at_a_time():
    torch.manual_seed(3)
    ahead = draw_unseeded(4, 37)
    torch.manual_seed(3)
    np.testing.assert_array_equal(ahead, np.stack([torch.rand(37).numpy() for _ in range(4)]))


def test_flat_rows_outside_the_candidates_still_get_an_exact_nucleus():
    # 1000 equally likely tokens: top_p 0.5 keeps 500 of them, far more than the candidate set.
    rows = 400
    out = sample(torch.zeros(rows, 1000), batch(rows, temperature=1.0, top_p=0.5))
    assert out.token_ids.max().item() < 501  # a stable sort keeps ties in id order
    assert len(set(out.token_ids.tolist())) > 150
    wide_k = sample(torch.zeros(rows, 1000), batch(rows, temperature=1.0, top_k=600))
    assert wide_k.token_ids.max().item() >= 256 and wide_k.token_ids.max().item() < 600


def test_a_nucleus_wider_than_the_first_candidates_uses_the_wider_ones():
    rows, vocab = 200, 8192
    # Nearly flat and decreasing: top_p 0.3 keeps fewer than 0.3 * vocab ids, well beyond 256.
    logits = (-torch.arange(vocab) * 1e-5).repeat(rows, 1)
    out = sample(logits, batch(rows, temperature=1.0, top_p=0.3))
    assert out.token_ids.max().item() <= int(0.3 * vocab) + 1
    assert out.token_ids.max().item() > 256


@pytest.fixture(params=["compiled", "numpy"])
def draw_path(request, monkeypatch):
    """The CPU's filtered draw with its first round compiled (executor/_sampling.c), or numpy's
    alone, as where no compiler built it."""
    import executor.sampler

    if request.param == "numpy":
        monkeypatch.setattr(executor.sampler, "_sampling", None)
    elif executor.sampler._sampling is None:
        pytest.skip("executor._sampling is not built here (test_the_compiled_round_is_built says where it must be)")
    return request.param


def test_the_compiled_round_is_built_where_a_compiler_is():
    # The editable install (the README's commands, CI's) builds it wherever a C compiler is; the
    # tests of the compiled path must not skip unseen there.
    import shutil
    import sysconfig
    from pathlib import Path

    import executor.sampler

    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    if not headers or not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler or no Python headers: numpy draws alone")
    assert executor.sampler._sampling is not None
    assert executor.sampler._sampling.INTERFACE == executor.sampler._SAMPLING_INTERFACE
    # A library older than its source runs what the source no longer says: `pip install -e .` again.
    source = Path(executor.sampler.__file__).with_name("_sampling.c")
    assert Path(executor.sampler._sampling.__file__).stat().st_mtime >= source.stat().st_mtime, "executor/_sampling.c changed since its build"


@pytest.mark.parametrize("peaked_only", [False, True, "confident"], ids=["every-widening", "first-round", "top-k-partition"])
def test_candidates_pick_exactly_what_a_full_sort_picks(peaked_only, draw_path):
    # The CPU's draw among candidates (compiled first round, then numpy; or numpy alone) and a
    # device's over the whole sorted row (_draw_sorted, torch), from the same probabilities.
    from executor.sampler import _draw_candidates, _draw_sorted

    g = torch.Generator().manual_seed(11)
    rows, vocab = 96, 3000
    # Peaked, medium and flat rows, ties included (rounded logits), so that every candidate
    # widening is taken; or peaked rows that all cut (top_p under 1), all drawn in the first round.
    # The picks must be those of the nucleus over the fully sorted row.
    # Or confident rows (one token 17.5 nats above the rest: nothing else within 2**-24 of it) under
    # a top-k alone, which the last round answers with each row's k most likely tokens, ties
    # included; half of them drawn with uniforms so near 1 that the tail's order decides the token.
    scale = torch.tensor([8.0] if peaked_only else [8.0, 2.0, 0.2]).repeat(rows if peaked_only else rows // 3)[:, None]
    logits = (torch.randn(rows, vocab, generator=g) * scale).round(decimals=1)
    if peaked_only == "confident":
        logits = torch.randn(rows, vocab, generator=g).round(decimals=1)
        logits[torch.arange(rows), torch.randint(vocab, (rows,), generator=g)] = logits.amax(dim=-1) + 17.5
    log_probs = torch.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    top_k = torch.randint(0, 50, (rows,), generator=g) * (torch.rand(rows, generator=g) < 0.4)
    if peaked_only == "confident":
        top_k = torch.randint(2, 400, (rows,), generator=g)
    cuts = torch.ones(rows, dtype=torch.bool) if peaked_only is True else torch.rand(rows, generator=g) < 0.8
    if peaked_only == "confident":
        cuts = torch.zeros(rows, dtype=torch.bool)
    top_p = torch.where(cuts, torch.rand(rows, generator=g) * 0.98 + 0.01, torch.ones(rows))
    uniforms = torch.rand(rows, generator=g)
    if peaked_only == "confident":
        uniforms[::2] = 1 - uniforms[::2] * 3e-6  # the tail holds ~4e-6 of the mass
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    on_host = _draw_candidates(log_probs.numpy(), k.numpy(), top_p.numpy(), uniforms.numpy())
    assert on_host.dtype == np.int64
    np.testing.assert_array_equal(on_host, _draw_sorted(probs, k, top_p, uniforms).numpy())


def _on_the_edges(log_probs: np.ndarray, rng: np.random.Generator) -> None:
    """Puts, in some rows, a token exactly on the first round's logprob threshold and one whose
    probability is exactly its floor (the largest's times the ratio), where >= and > part."""
    import executor.sampler as sampler

    ratio = sampler.CANDIDATE_RATIOS[0]
    log_ratio, margin = np.float32(np.log(ratio)), np.float32(sampler._LOG_MARGIN)
    exp = lambda x: torch.tensor([x]).exp().numpy()[0]  # noqa: E731
    for row in log_probs:
        top, column = row.max(), int(rng.integers(row.shape[0]))
        if row.shape[0] > 2 and row[column] != top and rng.random() < 0.5:
            row[column] = (top + log_ratio) - margin
        column = int(rng.integers(row.shape[0]))
        if row.shape[0] > 2 and row[column] != top and rng.random() < 0.5:
            floor, x = np.float32(exp(top) * np.float32(ratio)), np.float32(top + log_ratio)
            for _ in range(200):
                if exp(x) == floor:
                    row[column] = x
                    break
                x = np.nextafter(x, np.float32(np.inf if exp(x) < floor else -np.inf), dtype=np.float32)


def test_the_compiled_round_is_numpys_first_round_step_by_step():
    # gather()'s candidates, counts and largest logprobs are numpy's first-round candidates; the rows
    # it decides are those numpy's first round covers (and that fit its room), to the same tokens;
    # the rest are numpy's. Peaked, medium and flat rows, ties (rounded logits), tokens exactly on the
    # threshold and on the floor, -inf tokens (banned, masked), top-k and top-p, vocabularies that
    # are no multiple of the vector width, rows of more candidates than the room.
    import executor.sampler as sampler

    if sampler._sampling is None:
        pytest.skip("executor._sampling is not built here")
    rng = np.random.default_rng(21)
    ratio = sampler.CANDIDATE_RATIOS[0]
    log_ratio, margin = np.float32(np.log(ratio)), np.float32(sampler._LOG_MARGIN)
    decided = left = 0
    for vocab in (1, 2, 7, 17, 300, 1029, 3000, 20000):
        rows = 240 if vocab < 5000 else 48
        logits = (rng.standard_normal((rows, vocab)) * rng.choice([12.0, 4.0, 1.0, 0.05], (rows, 1))).round(1).astype(np.float32)
        logits[rng.random((rows, vocab)) < 0.1] = -np.inf
        logits[:, 0] = np.maximum(logits[:, 0], 0.0)  # every row keeps a finite token
        log_probs = torch.log_softmax(torch.from_numpy(logits), dim=-1).numpy().copy()
        _on_the_edges(log_probs, rng)
        k = np.where(rng.random(rows) < 0.4, rng.integers(1, 60, rows), vocab).astype(np.int64)
        top_p = np.where(rng.random(rows) < 0.8, rng.random(rows) * 0.99 + 0.01, 1.0).astype(np.float32)
        uniforms = rng.random(rows).astype(np.float32)

        room = min(vocab, sampler._COMPILED_ROOM)
        ids, values, counts = np.empty(rows * room, np.int32), np.empty(rows * (room + 1), np.float32), np.empty(rows, np.int64)
        total = sampler._sampling.gather(log_probs, vocab, float(log_ratio), float(margin), room, ids, values, counts)
        threshold = (log_probs.max(axis=1) + log_ratio) - margin
        at = 0
        for row in range(rows):
            expected = np.flatnonzero(log_probs[row] >= threshold[row])
            if expected.shape[0] > room:
                assert counts[row] == -1
                continue
            assert counts[row] == expected.shape[0]
            assert ids[at : at + counts[row]].tolist() == expected.tolist()
            np.testing.assert_array_equal(values[at : at + counts[row]], log_probs[row, expected])
            at += counts[row]
        assert total == at
        np.testing.assert_array_equal(values[total : total + rows], log_probs.max(axis=1))

        compiled = sampler._first_round_compiled(log_probs, k, top_p, uniforms)
        row_of, _, kept = sampler._candidates(log_probs, ratio, k)
        count = np.bincount(row_of, minlength=rows)
        mass = np.bincount(row_of, weights=kept, minlength=rows)
        covered = (k <= count) | ((top_p < 1) & (mass > top_p.astype(np.float64) + sampler._MASS_ROUNDING))
        np.testing.assert_array_equal(compiled >= 0, covered & (counts >= 0))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sampler, "_sampling", None)
            expected = sampler._draw_candidates(log_probs, k, top_p, uniforms)
        mine = compiled >= 0
        np.testing.assert_array_equal(compiled[mine], expected[mine])
        np.testing.assert_array_equal(sampler._draw_candidates(log_probs, k, top_p, uniforms), expected)
        decided, left = decided + int(mine.sum()), left + int((~mine).sum())
    assert decided > 500 and left > 100  # both kinds of row were there


def _numpys_first_round_pick(ids, probs, largest, k, top_p, u):
    """numpy's first round (_candidates' floor, _draw_candidates' coverage, _sorted_by_row,
    _pick_sorted) for one row given its candidates' probabilities: the token, or -1 when the
    round does not decide it."""
    import executor.sampler as sampler

    keep = probs >= np.float32(largest * np.float32(sampler.CANDIDATE_RATIOS[0]))
    kept_ids, kept = ids[keep], probs[keep]
    count = kept.shape[0]
    mass = np.bincount(np.zeros(count, np.int64), weights=kept, minlength=1)[0]  # numpy's sum, in order
    if not (k <= count or (top_p < 1 and mass > np.float64(top_p) + sampler._MASS_ROUNDING)):
        return -1
    sorted_probs, sorted_ids = sampler._sorted_by_row(np.zeros(count, np.int64), kept_ids, kept, np.array([count]))
    return int(sampler._pick_sorted(sorted_probs, sorted_ids, np.array([k]), np.array([top_p], np.float32), np.array([u], np.float32))[0])


def test_the_compiled_draw_rounds_where_numpy_rounds():
    # pick() on candidates made to sit where one rounding or one comparison decides: a probability
    # exactly on the floor or an ulp either side, a mass just over top_p (within the 1e-6 margin,
    # and on it), top_p exactly a candidate's float32 mass before it, a uniform whose target is
    # exactly a prefix sum; and the ties of dyadic probabilities.
    import executor.sampler as sampler

    if sampler._sampling is None:
        pytest.skip("executor._sampling is not built here")
    rng = np.random.default_rng(5)
    ratio = np.float32(sampler.CANDIDATE_RATIOS[0])
    up = lambda x, n=1: np.float32(x) if n == 0 else up(np.nextafter(np.float32(x), np.float32(1)), n - 1)  # noqa: E731
    down = lambda x: np.nextafter(np.float32(x), np.float32(0))  # noqa: E731
    rows = []
    for _ in range(3000):
        largest = np.float32(rng.choice([0.5, 0.375, 0.9, 0.61803]))
        floor = np.float32(largest * ratio)
        n = int(rng.integers(1, 40))
        probs = rng.choice([rng.random() * largest, floor, down(floor), up(floor), largest / 2**rng.integers(1, 13)], n).astype(np.float32)
        probs = np.minimum(probs, largest)
        probs[rng.integers(n)] = largest
        if rng.random() < 0.5:  # a mass just over, or on, top_p's margin
            probs = np.array([largest, up(1 - largest, int(rng.integers(0, 40)))], np.float32)
            n = 2
        ids = np.sort(rng.choice(100000, n, replace=False)).astype(np.int32)
        kept = np.sort(probs[probs >= floor])[::-1]
        before = (np.cumsum(kept, dtype=np.float64).astype(np.float32) - kept) if kept.shape[0] else np.zeros(1, np.float32)
        top_p = np.float32(rng.choice([1.0, rng.random(), before[rng.integers(before.shape[0])], np.float32(1 - largest)]))
        top_p = np.float32(min(max(top_p, 1e-3), 1.0))
        k = int(rng.choice([n, 100000, rng.integers(1, n + 1)]))
        sums = np.cumsum(kept, dtype=np.float64).astype(np.float32)
        u = np.float32(rng.random() if rng.random() < 0.5 or not sums.shape[0] else min(sums[rng.integers(sums.shape[0])] / sums[-1], down(1.0)))
        rows.append((ids, probs, largest, k, top_p, u))
    for _ in range(300):  # no top-k, and a mass that only the 1e-6 margin, or its float64 sum, keeps from covering top_p
        n = int(rng.integers(2, 60))
        probs = np.concatenate(([0.5], rng.uniform(2e-4, 0.5 / n, n - 1))).astype(np.float32)
        exact = np.bincount(np.zeros(n, np.int64), weights=probs)[0]
        rounded = np.add.accumulate(probs, dtype=np.float32)[-1]
        if rng.random() < 0.5 or exact == rounded:
            top_p = down(np.float32(exact))  # within the margin: not covered
        else:
            top_p = np.float32((exact + np.float64(rounded)) / 2 - sampler._MASS_ROUNDING)  # between the two sums
        rows.append((np.arange(n, dtype=np.int32), probs, np.float32(0.5), 100000, np.float32(min(top_p, 1.0)), np.float32(rng.random())))
    for _ in range(80):  # wide rows, which pick() sorts by their probabilities' bits: ties among dyadic ones, in id order
        n = int(rng.integers(1024, 3000))
        largest = np.float32(0.25)
        probs = np.where(rng.random(n) < 0.7, largest / 2.0 ** rng.integers(1, 12, n), rng.uniform(1e-5, 0.25, n)).astype(np.float32)
        probs[rng.integers(n)] = largest
        ids = np.sort(rng.choice(100000, n, replace=False)).astype(np.int32)
        k = int(rng.choice([n, 100000, rng.integers(1, n + 1)]))
        rows.append((ids, probs, largest, k, np.float32(rng.choice([1.0, rng.random()])), np.float32(rng.random())))
    counts = np.array([r[0].shape[0] for r in rows])
    all_ids = np.concatenate([r[0] for r in rows])
    all_probs = np.concatenate([np.concatenate([r[1] for r in rows]), np.array([r[2] for r in rows], np.float32)])
    drawn = np.empty(len(rows), np.int64)
    ks, top_ps, us = np.array([r[3] for r in rows]), np.array([r[4] for r in rows], np.float32), np.array([r[5] for r in rows], np.float32)
    sampler._sampling.pick(all_ids, all_probs, counts, float(ratio), ks, top_ps, us, drawn)
    expected = [_numpys_first_round_pick(*row) for row in rows]
    mismatched = [(i, drawn[i], expected[i]) for i in range(len(rows)) if drawn[i] != expected[i]]
    assert not mismatched, mismatched[:5]
    assert sum(e < 0 for e in expected) > 200 and sum(e >= 0 for e in expected) > 1000
    for probs, k, top_p, u in [  # hand-made: ties at exactly top_p's mass, targets exactly on a sum
        ([0.5, 0.25, 0.25], 3, 0.75, 0.5), ([0.5, 0.25, 0.25], 3, 0.5, 0.99), ([0.25] * 4, 4, 0.5, 0.5),
        ([0.1] * 10, 10, 0.3, 0.2), ([0.1] * 10, 10, 1.0, 0.5), ([0.4, 0.3, 0.2, 0.1], 2, 1.0, 0.999999),
        ([0.125] * 8, 8, 0.375, 1 - 2**-24), ([0.5, 0.5], 1, 1.0, 0.75),
        # A uniform of 1 (no draw makes one) passes every sum: numpy's clamp takes the last candidate
        # in order, past the cut, which pick() leaves on its heap.
        ([0.4, 0.3, 0.2, 0.1], 2, 1.0, 1.0), ([0.1, 0.2, 0.4, 0.3, 0.2], 5, 0.5, 1.0), ([0.3, 0.3, 0.4], 3, 1.0, 1.0),
    ]:  # fmt: skip
        p = np.array(probs, np.float32)
        sampler._sampling.pick(np.arange(p.shape[0], dtype=np.int32), np.append(p, p.max()), np.array([p.shape[0]]), float(ratio),
                               np.array([k]), np.array([top_p], np.float32), np.array([u], np.float32), drawn[:1])  # fmt: skip
        assert drawn[0] == _numpys_first_round_pick(np.arange(p.shape[0]), p, p.max(), k, np.float32(top_p), np.float32(u))


def test_the_compiled_finite_check_and_division_are_torchs_to_the_bit():
    # finite_scaled() in place of _finite_rows, the zeroing of non-finite rows and torch's division
    # by the temperature: wide and tiny logits, denormals, quotients that overflow to inf (finite
    # logits at the lowest temperature: _overflowed flags those rows after log_softmax), NaN and
    # infinities anywhere in a row, vocabularies that are not a multiple of the vector width.
    import executor.sampler as sampler

    if sampler._sampling is None:
        pytest.skip("executor._sampling is not built here")
    g = torch.Generator().manual_seed(8)
    for vocab in (1, 5, 16, 17, 1000, 49152):
        rows = 12
        logits = torch.randn(rows, vocab, generator=g) * torch.tensor([1e-40, 1e-3, 1.0, 30.0, 1e30, 3e38] * 2)[:, None]
        logits[1, -1] = float("nan")
        logits[4, 0] = float("inf")
        logits[7, vocab // 2] = float("-inf")
        scale = np.array([1.0, 0.7, 1e-5, 2.5, 1.0, 0.3, 1e-5, 0.9, 1.0, 3.0, 1.7, 1e-5], np.float32)
        finite, scaled = sampler._finite_scaled_compiled(logits, scale, True)
        expected_finite = torch.isfinite(logits).all(dim=-1).numpy()
        np.testing.assert_array_equal(finite, expected_finite)
        safe = logits.masked_fill(torch.from_numpy(~expected_finite).unsqueeze(1), 0.0)
        expected = (safe / torch.from_numpy(scale).unsqueeze(1)).numpy()
        np.testing.assert_array_equal(scaled.numpy().view(np.uint32), expected.view(np.uint32))
        finite, same = sampler._finite_scaled_compiled(logits, np.ones(rows, np.float32), False)
        np.testing.assert_array_equal(finite, expected_finite)
        np.testing.assert_array_equal(same.numpy().view(np.uint32), safe.numpy().view(np.uint32))
        clean = logits.clone()
        clean[~torch.from_numpy(expected_finite)] = 0.0
        assert sampler._finite_scaled_compiled(clean, np.ones(rows, np.float32), False)[1] is clean  # nothing to zero: no copy


def test_sampling_leaves_the_callers_logits_as_they_were(draw_path):
    # The compiled pass hands back the caller's logits themselves when there is nothing to divide
    # or zero; nothing after it may write into them (a non-finite row, temperature 1, top-p).
    logits = random_logits(4, vocab=300)
    logits[2, 5] = float("nan")
    before = logits.clone()
    for temperature in (1.0, 0.7, 0.0):
        sample(logits, batch(4, temperature=temperature, top_p=0.9, seeds=3))
        assert torch.equal(logits.isnan(), before.isnan()) and torch.equal(logits.nan_to_num(), before.nan_to_num())


def test_a_build_of_another_interface_is_not_used(caplog):
    # A checkout pulled without `pip install -e .` again keeps the library of the older source:
    # sampling then goes without it, said, instead of calling what it no longer has.
    import types

    import executor.sampler as sampler

    with caplog.at_level("WARNING", logger="executor.sampler"):
        assert sampler._usable(types.SimpleNamespace(INTERFACE=sampler._SAMPLING_INTERFACE - 1, __file__="old.so")) is None
    assert "old.so was built from another executor/_sampling.c" in caplog.text
    current = types.SimpleNamespace(INTERFACE=sampler._SAMPLING_INTERFACE, __file__="new.so")
    assert sampler._usable(current) is current and sampler._usable(None) is None


def test_the_compiled_round_refuses_buffers_that_do_not_fit():
    import executor.sampler as sampler

    if sampler._sampling is None:
        pytest.skip("executor._sampling is not built here")
    log_probs = np.zeros((3, 10), np.float32)
    ids, values, counts = np.empty(30, np.int32), np.empty(33, np.float32), np.empty(3, np.int64)
    assert sampler._sampling.gather(log_probs, 10, -8.0, 0.001, 10, ids, values, counts) == 30
    with pytest.raises(ValueError, match="whole rows"):
        sampler._sampling.gather(log_probs, 7, -8.0, 0.001, 7, ids, values, counts)
    with pytest.raises(ValueError, match="values"):
        sampler._sampling.gather(log_probs, 10, -8.0, 0.001, 10, ids, values[:32], counts)
    with pytest.raises(ValueError, match="ids"):
        sampler._sampling.gather(log_probs, 10, -8.0, 0.001, 10, ids.astype(np.int64), values, counts)
    with pytest.raises(BufferError, match="not writable"):
        sampler._sampling.gather(log_probs, 10, -8.0, 0.001, 10, b"read-only" * 20, values, counts)
    with pytest.raises(ValueError, match="temperature"):
        sampler._sampling.finite_scaled(log_probs, 10, np.ones(2, np.float32), None, np.empty(3, np.uint8))
    with pytest.raises(ValueError, match="out"):
        sampler._sampling.finite_scaled(log_probs, 10, np.ones(3, np.float32), np.empty(29, np.float32), np.empty(3, np.uint8))
    with pytest.raises(ValueError, match="logits"):  # another byte order, read as this host's
        sampler._sampling.finite_scaled(log_probs.astype(">f4"), 10, np.ones(3, np.float32), None, np.empty(3, np.uint8))
    with pytest.raises(ValueError, match="room"):
        sampler._sampling.gather(log_probs, 10, -8.0, 0.001, 2**62, ids, values, counts)
    with pytest.raises(ValueError, match="values"):  # the dtype, not only the width
        sampler._sampling.gather(log_probs, 10, -8.0, 0.001, 10, ids, values.view(np.int32), counts)
    out = np.empty(3, np.int64)
    probs = np.full(33, 0.1, np.float32)
    with pytest.raises(ValueError, match="more candidates than ids"):
        sampler._sampling.pick(ids[:29], probs, counts, 2.0**-12, np.full(3, 10), np.ones(3, np.float32), np.ones(3, np.float32), out)
    with pytest.raises(ValueError, match="uniforms"):
        sampler._sampling.pick(ids, probs, counts, 2.0**-12, np.full(3, 10), np.ones(3, np.float32), np.ones(3), out)
    with pytest.raises(ValueError, match="uniforms"):
        sampler._sampling.pick(ids, probs, counts, 2.0**-12, np.full(3, 10), np.ones(3, np.float32), np.ones(2, np.float32), out)
    assert sampler._sampling.pick(ids, probs, counts, 2.0**-12, np.full(3, 10), np.ones(3, np.float32), np.full(3, 0.5, np.float32), out) == 0
    # Ten ties of 0.1: u = 0.5 passes the fifth, whose sum is the target (searchsorted's right=True).
    assert out.tolist() == [5, 5, 5]
    numpys = sampler._pick_sorted(np.full((1, 10), 0.1, np.float32), np.arange(10)[None, :], np.array([10]), np.ones(1, np.float32), np.full(1, 0.5, np.float32))
    assert numpys.tolist() == [5]


def test_plain_rows_of_a_wide_vocabulary_are_drawn_through_block_sums():
    # A CPU draws a plain row of 4096+ columns by the block its target falls in, then the column in
    # that block (_draw_plain): the same distribution as one prefix sum over the row, never a
    # column of no weight, whatever the uniform.
    from executor.sampler import _PLAIN_BLOCK, _draw_plain, _inverse_cdf

    vocab, rows = 16 * _PLAIN_BLOCK, 40000
    weights = torch.zeros(vocab)
    # Weight on both sides of a block edge, in the last column, after blocks of none.
    weights[_PLAIN_BLOCK - 1], weights[_PLAIN_BLOCK], weights[vocab - 1] = 0.5, 0.3, 0.2
    g = torch.Generator().manual_seed(5)
    uniforms = torch.cat((torch.rand(rows - 3, generator=g), torch.tensor([0.0, 0.5, 1 - 2**-24])))
    picks = _draw_plain(weights.repeat(rows, 1), uniforms)
    assert set(picks.tolist()) <= {_PLAIN_BLOCK - 1, _PLAIN_BLOCK, vocab - 1}
    freq = torch.bincount(picks, minlength=vocab)[[_PLAIN_BLOCK - 1, _PLAIN_BLOCK, vocab - 1]].float() / rows
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.01, rtol=0)
    # Model-like rows: the very tokens of one prefix sum, but where rounding puts a target on a
    # column's edge.
    probs = torch.softmax(torch.randn(500, 49152, generator=g) * 3, dim=-1)
    uniforms = torch.rand(500, generator=g)
    assert (_draw_plain(probs, uniforms) == _inverse_cdf(probs, uniforms)).float().mean() > 0.99
    # Narrow or uneven vocabularies, and a device's rows, take the one prefix sum.
    for narrow in (torch.rand(3, 4095, generator=g), torch.rand(3, 4096 + 7, generator=g)):
        assert torch.equal(_draw_plain(narrow, uniforms[:3]), _inverse_cdf(narrow, uniforms[:3]))
    assert _draw_plain(torch.empty(2, vocab, device="meta"), torch.empty(2, device="meta")).shape == (2,)


def test_the_last_round_takes_a_top_k_rows_k_most_likely_tokens_and_their_ties():
    # A confident row under top-k has fewer than k tokens within 2**-24 of its most likely one; the
    # last round then partitions it: its candidates are exactly the tokens at or above its k-th
    # largest logprob (ties included), and a row with no top-k (k = vocabulary) keeps every token.
    from executor.sampler import _candidates

    g = torch.Generator().manual_seed(3)
    rows, vocab = 40, 2000
    logits = torch.randn(rows, vocab, generator=g).round(decimals=1)  # many ties
    logits[torch.arange(rows), torch.randint(vocab, (rows,), generator=g)] += 30.0
    log_probs = torch.log_softmax(logits, dim=-1).numpy()
    k = torch.randint(1, 300, (rows,), generator=g).numpy()
    k[::5] = vocab
    row_of, ids, values = _candidates(log_probs, 0.0, k)
    for row in range(rows):
        kth = np.sort(log_probs[row])[::-1][k[row] - 1]
        assert ids[row_of == row].tolist() == np.flatnonzero(log_probs[row] >= kth).tolist(), row
    assert (np.bincount(row_of, minlength=rows)[::5] == vocab).all()
    np.testing.assert_array_equal(values, torch.from_numpy(log_probs[row_of, ids]).exp().numpy())


def test_host_rows_that_do_not_describe_the_batch_are_refused():
    logits = random_logits(6)
    mixed = batch(6, temperature=[0.0, 0.8, 0.0, 1.0, 0.0, 0.5], seeds=[1, 2, 3, 4, -1, 6], top_p=[1, 1, 1, 0.9, 1, 1], top_k=[0, 3, 0, 0, 0, 0])
    assert mixed.host.greedy.tolist() == [True, False, True, False, True, False]
    assert mixed.host.filtered.tolist() == [False, True, False, True, False, False]
    short = SamplingBatch.of([0.0] * 5, [1.0] * 5, [0] * 5, [-1] * 5, range(5))
    with pytest.raises(SamplingError, match=r"expected \(5,\): the host rows describe 5 rows"):
        sample(logits, replace(mixed, host=short.host))
    # Refused where they are built (a rank's link thread), not in every sample() call.
    with pytest.raises(SamplingError, match="top_p must be .* as long as temperature"):
        replace(mixed.host, top_p=np.ones(5, dtype=np.float32))
    with pytest.raises(SamplingError, match="temperature must be .* floating-point"):  # 0.5 as an int is 0: greedy
        replace(mixed.host, temperature=np.zeros(6, dtype=np.int64))
    with pytest.raises(SamplingError, match="top_k must be .* integer"):
        replace(mixed.host, top_k=np.zeros(6))
    with pytest.raises(SamplingError, match="seeds"):
        replace(mixed.host, seeds=np.zeros(6))
    with pytest.raises(SamplingError, match="num_logprobs"):
        replace(mixed.host, num_logprobs=np.ones(5, dtype=np.uint8))
    for wrapping in (-1, 256):  # the compiled pass reads them as uint8
        with pytest.raises(SamplingError, match="num_logprobs must be in 0 to 255"):
            replace(mixed.host, num_logprobs=np.array([0, 0, wrapping, 0, 0, 0], dtype=np.int64))


def test_host_rows_derive_each_rows_draw_where_they_are_built():
    # What sample() reads of the rows comes made with them (a rank's link thread stages them while
    # the forward before runs), and a later forward's rows (one position on) derive it afresh.
    mixed = batch(
        6, temperature=[0.0, 0.8, 0.0, 1.0, 0.5, 2.0], top_p=[1, 1, 1, 0.9, 1, 1], top_k=[0, 3, 0, 0, 0, 0],
        seeds=[5, 2, -1, -1, 7, 9], positions=[10, 11, 12, 13, 14, 15],
    ).host  # fmt: skip
    assert mixed.random.tolist() == [1, 3, 4, 5]
    assert mixed.scale.tolist() == pytest.approx([1.0, 0.8, 1.0, 1.0, 0.5, 2.0]) and mixed.dividing
    assert mixed.plain_rows.tolist() == [4, 5] and mixed.random[mixed.plain].tolist() == [4, 5]
    assert mixed.cut_rows.tolist() == [1, 3] and mixed.random[mixed.cut].tolist() == [1, 3]
    assert mixed.cut_top_k.tolist() == [3, 0] and mixed.cut_top_p.tolist() == pytest.approx([1.0, 0.9])
    assert mixed.random[mixed.seeded].tolist() == [1, 4, 5]  # row 0's seed is a greedy row's: never drawn
    expected = [(row_seed(seed, position) >> 40) * 2.0**-24 for seed, position in ((2, 11), (7, 14), (9, 15))]
    assert mixed.seeded_uniforms.tolist() == expected
    torch.manual_seed(0)
    uniforms = mixed.uniforms()
    assert uniforms.shape == (4,) and uniforms[mixed.seeded].tolist() == expected
    later = mixed.one_position_on()  # a later forward of a step of several
    assert later.seeded_uniforms.tolist() == [(row_seed(s, p + 1) >> 40) * 2.0**-24 for s, p in ((2, 11), (7, 14), (9, 15))]
    derived = replace(mixed, positions=mixed.positions + 1)
    for name in (f.name for f in fields(HostRows)):
        a, b = getattr(later, name), getattr(derived, name)
        assert (a == b if not isinstance(a, np.ndarray) else a.dtype == b.dtype and np.array_equal(a, b)), name
    assert mixed.positions.tolist() == [10, 11, 12, 13, 14, 15]  # the rows before are as they were
    assert not batch(3, temperature=[0.0, 1.0, 1.0]).host.dividing  # x / 1 is x: no pass


def test_on_a_device_the_sampler_reads_nothing_back():
    # A GPU's host stalls at every read of a device value (bool(), .item(), nonzero, a copy): the
    # GPU check's trace showed eight between two forwards. "meta" tensors hold no data, so any
    # such read raises: greedy rows, rows drawn with a temperature (seeded or not), top-k and
    # top-p rows and logprob alternatives read nothing back. The CPU's path does read (it branches
    # on the values and draws in numpy): the test's negative control.
    from executor.sampler import _sample_on_host

    rows, vocab = 4, 50
    temperature = [0.0, 0.7, 1.0, 0.0]
    params = SamplingBatch.of(temperature, [1.0] * rows, [0] * rows, [-1, 5, -1, -1], range(rows), device="meta",
                              num_logprobs=np.array([2, 0, 1, 0], dtype=np.uint8))  # fmt: skip
    out = sample(torch.empty(rows, vocab, device="meta"), params)
    assert out.token_ids.shape == (rows,) and out.token_ids.device.type == "meta"
    assert out.top_ids.shape == (rows, 2) and out.top_ids.device.type == "meta"
    filtered = SamplingBatch.of(temperature, [1.0, 0.9, 1.0, 0.5], [0, 0, 5, 3], [-1, 7, -1, -1], range(rows), device="meta")
    out = sample(torch.empty(rows, vocab, device="meta"), filtered)
    assert out.token_ids.shape == (rows,) and out.token_ids.device.type == "meta"
    with pytest.raises(TypeError, match="meta"):
        _sample_on_host(torch.empty(rows, vocab, device="meta"), filtered)


def test_a_devices_sample_comes_to_the_host_in_one_copy_unchanged():
    from executor.sampler import SampleOutput
    from executor.steps import pack_sampled, sampled_to_host, unpack_sampled

    tokens = torch.tensor([0, 49151, 2**31 - 1, 7])
    logprobs = torch.tensor([-0.5, -12.25, float("nan"), -1e-7])
    finite = torch.tensor([True, True, False, True])
    top_ids = torch.tensor([[0, 5], [49151, 3], [0, 0], [7, 2**31 - 1]])
    top_logprobs = torch.tensor([[-0.5, -1.0], [-12.25, -13.0], [float("nan")] * 2, [-1e-7, -30.5]])
    for alternatives in (False, True):
        out = SampleOutput(
            token_ids=tokens, logprobs=logprobs, finite=finite,
            top_ids=top_ids if alternatives else None, top_logprobs=top_logprobs if alternatives else None,
        )  # fmt: skip
        direct = sampled_to_host(out)  # the CPU's own path
        packed = unpack_sampled(pack_sampled(out), 4)  # a GPU's path, but for the copy
        for name in ("tokens", "finite", "logprobs", "top_ids", "top_logprobs"):
            a, b = getattr(direct, name), getattr(packed, name)
            if not alternatives and name.startswith("top"):
                assert a is None and b is None
                continue
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a, b)
        assert [direct.tokens.dtype, direct.finite.dtype, direct.logprobs.dtype] == [np.int32, np.uint8, np.float32]


# draw_path is set once for all of the examples: that is all it does.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_cpus_path_samples_what_a_devices_path_samples(draw_path, data):
    # The CPU's passes (compiled and numpy draws among candidates, branches on values) and the device path (torch
    # only, rows sorted whole, nothing read back) run on the same CPU logits must give the same
    # tokens, logprobs, flags and alternatives for every kind of row: greedy, plain, top-k, top-p,
    # min_p, seeded and not, non-finite, with ties and flat rows, so that the two cannot drift.
    # (The CPU's one compiled pass, with an exponential of its own, is held to the passes below.)
    from executor.sampler import _sample_in_passes, _sample_on_device

    rows = data.draw(st.integers(1, 12), label="rows")
    vocab = data.draw(st.sampled_from([5, 64, 700, 8192]), label="vocab")  # 8192: plain rows by block sums
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.05, 1.0, 6.0, 30.0]), min_size=rows, max_size=rows), label="scale"))
    logits = (torch.randn(rows, vocab, generator=g) * scale[:, None]).round(decimals=data.draw(st.sampled_from([1, 4]), label="decimals"))
    for row in data.draw(st.lists(st.integers(0, rows - 1), max_size=3), label="confident rows"):
        logits[row, int(torch.randint(vocab, (1,), generator=g))] += 40.0  # nothing else within 2**-24
    for row in data.draw(st.lists(st.integers(0, rows - 1), max_size=2), label="non-finite rows"):
        logits[row, int(torch.randint(vocab, (1,), generator=g))] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    col = lambda strategy, label: data.draw(st.lists(strategy, min_size=rows, max_size=rows), label=label)  # noqa: E731
    temperature = col(st.sampled_from([0.0, 0.3, 1.0, 2.5]), "temperature")
    top_p = col(st.sampled_from([1.0, 0.95, 0.5, 0.01]), "top_p")
    top_k = col(st.sampled_from([0, 1, 3, 50]), "top_k")
    seeds = col(st.sampled_from([-1, 0, 7, 2**40]), "seeds")
    wanted = np.array(col(st.sampled_from([0, 0, 1, 3]), "num_logprobs"), dtype=np.uint8)
    min_p = col(st.sampled_from([0.0, 0.0, 0.1, 0.9]), "min_p")
    min_p_rows = [r for r in range(rows) if min_p[r] > 0]
    processing = min_p_only(min_p_rows, [min_p[r] for r in min_p_rows]) if min_p_rows else None
    params = SamplingBatch.of(temperature, top_p, top_k, seeds, range(rows), processing=processing, num_logprobs=wanted)
    torch.manual_seed(seed)  # the unseeded rows' uniforms come from the default generator
    on_host = _sample_in_passes(logits.clone(), params, params.host.uniforms())
    torch.manual_seed(seed)
    on_device = _sample_on_device(logits.clone(), params)
    assert on_host.token_ids.dtype == on_device.token_ids.dtype == torch.int64
    assert torch.equal(on_host.finite, on_device.finite)
    assert torch.equal(on_host.token_ids, on_device.token_ids), (on_host.token_ids, on_device.token_ids)
    torch.testing.assert_close(on_host.logprobs, on_device.logprobs, equal_nan=True, rtol=0, atol=0)
    if wanted.max() == 0:
        assert on_host.top_ids is None and on_device.top_ids is None
    else:
        assert torch.equal(on_host.top_ids, on_device.top_ids)
        torch.testing.assert_close(on_host.top_logprobs, on_device.top_logprobs, equal_nan=True, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_one_compiled_pass_samples_what_the_passes_sample(data):
    # A CPU row that no logits processing touches is drawn in one compiled call with an exponential
    # of its own: the same finite flags and tokens as the torch / numpy passes, logprobs within
    # float32 rounding of torch's log_softmax, and the same alternatives but where two of them are
    # that near (torch's topk orders ties its own way). The logits are continuous (no ties), so that
    # no draw sits on a token's edge, where the two may round apart; ties are the next tests'. The
    # rows it leaves (min_p processing) are the passes' to the bit, alternatives included, with the
    # same uniforms.
    import executor.sampler as sampler

    if sampler._sampling is None:
        pytest.skip("executor._sampling is not built here (test_the_compiled_round_is_built says where it must be)")
    rows = data.draw(st.integers(1, 12), label="rows")
    vocab = data.draw(st.sampled_from([1, 5, 17, 64, 700, 8192, 49152]), label="vocab")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor(data.draw(st.lists(st.sampled_from([0.01, 1.0, 6.0, 30.0]), min_size=rows, max_size=rows), label="scale"))
    logits = torch.randn(rows, vocab, generator=g) * scale[:, None]
    for row in data.draw(st.lists(st.integers(0, rows - 1), max_size=2), label="non-finite rows"):
        logits[row, int(torch.randint(vocab, (1,), generator=g))] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    if data.draw(st.booleans(), label="a row the temperature overflows"):
        logits[0, 0] = 3e38
    col = lambda strategy, label: data.draw(st.lists(strategy, min_size=rows, max_size=rows), label=label)  # noqa: E731
    wanted = np.array(col(st.sampled_from([0, 0, 0, min(2, vocab)]), "num_logprobs"), dtype=np.uint8)
    min_p_rows = [r for r, on in enumerate(col(st.sampled_from([False, False, True]), "min_p rows")) if on]
    processing = min_p_only(min_p_rows, [0.2] * len(min_p_rows)) if min_p_rows else None
    params = SamplingBatch.of(
        col(st.sampled_from([0.0, 0.01, 0.3, 1.0, 2.5]), "temperature"), col(st.sampled_from([1.0, 0.95, 0.5, 0.01]), "top_p"),
        col(st.sampled_from([0, 1, 3, 50]), "top_k"), col(st.sampled_from([-1, 0, 7]), "seeds"), range(rows),
        processing=processing, num_logprobs=wanted,
    )  # fmt: skip
    torch.manual_seed(seed)
    uniforms = params.host.uniforms() if params.host.random.shape[0] else np.zeros(0, dtype=np.float32)
    draws = params.host.draws.copy()
    draws[min_p_rows] = sampler.DRAW_ELSEWHERE
    compiled, left = sampler._sample_compiled(logits.clone(), params.host, uniforms, draws)
    passes = sampler._sample_in_passes(logits.clone(), params, uniforms)
    torch.manual_seed(seed)
    whole = sample(logits.clone(), params)
    left = np.zeros(0, dtype=np.int64) if left is None else left
    assert set(left.tolist()) >= set(min_p_rows)
    assert torch.equal(whole.token_ids[left], passes.token_ids[left])
    torch.testing.assert_close(whole.logprobs[left], passes.logprobs[left], equal_nan=True, rtol=0, atol=0)
    if wanted.max():
        assert torch.equal(whole.top_ids[left], passes.top_ids[left])
        torch.testing.assert_close(whole.top_logprobs[left], passes.top_logprobs[left], equal_nan=True, rtol=0, atol=0)
    else:
        assert whole.top_ids is None
    decided = torch.from_numpy(np.setdiff1d(np.arange(rows), left))
    names = ("token_ids", "logprobs", "finite") + (("top_ids", "top_logprobs") if wanted.max() else ())
    for name in names:  # sample() gives the pass's own for its rows
        torch.testing.assert_close(getattr(whole, name)[decided], getattr(compiled, name)[decided], equal_nan=True, rtol=0, atol=0)
    for r in decided.tolist() if wanted.max() else ():
        ours, theirs = compiled.top_logprobs[r], passes.top_logprobs[r]
        torch.testing.assert_close(ours, theirs, equal_nan=True, rtol=2e-6, atol=2e-5)
        if not passes.finite[r] or not wanted[r]:
            assert torch.equal(compiled.top_ids[r], passes.top_ids[r])
            continue
        temperature = params.host.temperature[r]
        exact = torch.log_softmax(logits[r] / temperature if temperature > 0 else logits[r], dim=-1)
        for i, (a, b) in enumerate(zip(compiled.top_ids[r].tolist(), passes.top_ids[r].tolist())):
            assert a == b or abs(exact[a] - theirs[i]) <= 2e-5 + 2e-6 * abs(theirs[i]), (r, i, a, b)  # a near-tie
    assert torch.equal(compiled.finite[decided], passes.finite[decided])
    host, by_row = params.host, params.host.by_row(uniforms)
    for r in decided.tolist():  # a cut row's draw may move by a token where its cut or target sits within rounding of an edge
        if compiled.token_ids[r] != passes.token_ids[r]:
            assert host.draws[r] == sampler.DRAW_CUT, (r, compiled.token_ids, passes.token_ids)
            row = (host.temperature[r], host.top_k[r], host.top_p[r], by_row[r])
            assert _passes_draw_near(logits[r], *row, int(compiled.token_ids[r])), (r, row, compiled.token_ids, passes.token_ids)
            compiled.logprobs[r] = passes.logprobs[r] = 0.0  # another token's logprob
    torch.testing.assert_close(compiled.logprobs[decided], passes.logprobs[decided], equal_nan=True, rtol=2e-6, atol=2e-5)


def test_the_compiled_pass_keeps_each_rows_most_likely_tokens_in_order():
    # A row's alternatives are the largest of its x / t - top as the pass makes them in float32 (the
    # same value as numpy's), as many as the greediest row wants, most likely first and equal ones
    # in id order; their logprobs torch's log_softmax to float32 rounding, and the drawn token's
    # own where it is among them. Rows that want none, or are not finite, hold ids 0 and NaN.
    import executor.sampler as sampler

    if sampler._sampling is None:
        pytest.skip("executor._sampling is not built here")
    rows, vocab, width = 9, 3000, 20
    g = torch.Generator().manual_seed(4)
    logits = torch.randint(0, 6, (rows, vocab), generator=g).float() * 0.5  # hundreds of ties a value
    logits[1] = torch.randn(vocab, generator=g) * 3
    logits[2, 7] = math.nan
    logits[8] = torch.randn(vocab, generator=g) * 0.01  # flat: a cut row drawn over its whole row
    t = [0.0, 0.7, 1.0, 1.3, 0.0, 2.0, 0.3, 1.0, 1.0]
    wanted = [5, width, 3, 0, 1, width, 7, 2, 4]
    top_p = [1.0, 0.9, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 0.95]
    params = SamplingBatch.of(t, top_p, [0] * rows, [-1] * rows, range(rows), num_logprobs=np.array(wanted, np.uint8))
    out = sample(logits, params)
    assert out.top_ids.shape == out.top_logprobs.shape == (rows, width)
    for r in range(rows):
        if not wanted[r] or r == 2:
            assert out.top_ids[r].tolist() == [0] * width and out.top_logprobs[r].isnan().all(), r
            continue
        scale = np.float32(t[r] if t[r] > 0 else 1.0)
        x = logits[r].numpy()
        v = (x / scale if scale != 1 else x) - (x.max() / scale if scale != 1 else x.max())
        order = np.lexsort((np.arange(vocab), -v))[:width]
        assert out.top_ids[r].tolist() == order.tolist(), r
        exact = torch.log_softmax(torch.from_numpy(x / scale), dim=-1)[torch.from_numpy(order)]
        torch.testing.assert_close(out.top_logprobs[r], exact, rtol=2e-6, atol=2e-5)
        token = int(out.token_ids[r])
        if token in order.tolist():
            assert out.logprobs[r] == out.top_logprobs[r, order.tolist().index(token)], r


def _passes_draw_near(logits_row: torch.Tensor, temperature: float, k: int, top_p: float, u: float, token: int) -> bool:
    """Whether `token` is one the passes' draw over the whole sorted row (their last round, from
    torch's log_softmax) could pick with top_p moved by up to 2e-5 and the uniform by up to 2e-6 of
    itself: the drawn rank grows with both, so the tokens between the draws at the two ends, and
    any whose probability is within a few ulps of theirs (near-ties another exponential orders the
    other way). The compiled pass's probabilities are torch's to float32 rounding, and torch's
    float32 sum of a row of 49,152 is off by up to ~5e-6 of the mass (the logprobs' own tolerance
    below is 2e-5): where the top-p cut falls on a flat tail that moves the cut, and with it the
    draw, by a few tokens."""
    import executor.sampler as sampler

    scaled = logits_row.float() / temperature if temperature > 0 else logits_row.float()
    probs = torch.log_softmax(scaled, dim=-1).exp().numpy()[None, :]
    order = np.argsort(-probs, axis=1, kind="stable")
    sorted_probs = np.take_along_axis(probs, order, axis=1)
    row_k = np.array([k if k > 0 else probs.shape[1]])
    ranks = []
    for side in (-1, 1):
        cut = np.array([min(top_p + side * 2e-5, 1.0) if top_p < 1 else 1.0], np.float32)
        below_one = np.nextafter(np.float32(1), np.float32(0))  # a uniform of 1 would clamp past the cut
        drawn = int(sampler._pick_sorted(sorted_probs, order, row_k, cut, np.array([min(u * (1 + side * 2e-6), below_one)], np.float32))[0])
        ranks.append(int(np.flatnonzero(order[0] == drawn)[0]))
    ulps = 4 * np.finfo(np.float32).eps
    highest, lowest = sorted_probs[0, ranks[0]], sorted_probs[0, ranks[1]]
    return bool(lowest * (1 - ulps) <= probs[0, token] <= highest * (1 + ulps))


def test_a_flat_row_is_drawn_over_its_whole_row_as_the_passes_draw_it():
    # A cut row whose nucleus is not inside its first candidates (more than the room of 8,192 within
    # 2^-12 of its top, or a tail too wide) is drawn by the compiled pass among all its tokens, as
    # the passes' last round does: the same tokens, but where the cut or the target sits within
    # float32 rounding of an edge, and logprobs within that rounding; ties (all-equal logits) in id order.
    import executor.sampler as sampler

    if sampler._sampling is None:
        pytest.skip("executor._sampling is not built here")
    rows, vocab = 24, 49152
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(rows, vocab, generator=g) * torch.tensor([0.0, 0.01, 0.5, 1.5, 3.0, 5.0] * 4)[:, None]
    t = np.array([1.0, 0.7, 1.3, 1.0] * 6)
    top_p = np.array([0.95, 0.5, 0.99, 0.9, 0.999, 0.3] * 4)
    top_k = np.array([0] * 18 + [100, 20000, 0, 5000, 1, 0])
    host = HostRows.of(t, top_p, top_k, np.full(rows, -1), np.arange(rows))
    assert (host.draws == sampler.DRAW_CUT).all()
    uniforms = np.random.default_rng(3).random(rows, dtype=np.float32)
    compiled, left = sampler._sample_compiled(logits.clone(), host, uniforms, host.draws)
    assert left is None
    params = SamplingBatch.of(t, top_p, top_k, np.full(rows, -1), np.arange(rows))
    passes = sampler._sample_in_passes(logits.clone(), params, uniforms)
    same = compiled.token_ids == passes.token_ids
    assert int(same.sum()) >= rows - 2, (compiled.token_ids, passes.token_ids)
    for r in np.flatnonzero(~same.numpy()).tolist():
        assert _passes_draw_near(logits[r], t[r], int(top_k[r]), float(top_p[r]), float(uniforms[r]), int(compiled.token_ids[r])), r
    torch.testing.assert_close(compiled.logprobs[same], passes.logprobs[same], rtol=2e-6, atol=2e-5)
    assert int(compiled.token_ids[0]) == int(passes.token_ids[0]) and int(compiled.token_ids[0]) < vocab  # ties: id order


def test_the_compiled_pass_keeps_ties_in_id_order_and_its_logprobs_near_float64():
    import executor.sampler as sampler

    if sampler._sampling is None:
        pytest.skip("executor._sampling is not built here")
    # Exact ties: 640 equally likely tokens, top-p 0.5 keeps the first 320 (and at most one more
    # where the rounding of 320 / 640 falls above 0.5); top-k 3 the first three.
    tied = torch.zeros(400, 640)
    def compiled(logits, params, uniforms):
        out, left = sampler._sample_compiled(logits, params.host, uniforms, params.host.draws)
        assert left is None, "the pass left rows undecided"
        return out

    nucleus = compiled(tied, batch(400, temperature=1.0, top_p=0.5), torch.rand(400).numpy())
    assert nucleus.token_ids.max().item() <= 320 and len(set(nucleus.token_ids.tolist())) > 150
    three = compiled(tied, batch(400, temperature=1.0, top_k=3), torch.rand(400).numpy())
    assert set(three.token_ids.tolist()) == {0, 1, 2}
    # Greedy rows: the first largest column, and a logprob within float32 rounding of float64's.
    logits = random_logits(6, vocab=49152 + 7)
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1.0
    greedy = compiled(logits, batch(6), np.zeros(0, dtype=np.float32))
    assert torch.equal(greedy.token_ids, logits.argmax(dim=-1)) and greedy.token_ids[1] == 5
    exact = torch.log_softmax(logits.double(), dim=-1).gather(1, greedy.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(greedy.logprobs.double(), exact, rtol=1e-6, atol=1e-6)
    # A plain row whose draw falls among weights so small that a block's float32 lanes and the
    # column-by-column float64 walk round them apart: the target's share of the block is carried
    # over in proportion, so the draw is the passes' (before, every such draw fell on the block's
    # last column of any weight), and never a column of no weight.
    for columns in ([16 * i for i in range(1, 16)], list(range(241, 256)), list(range(1, 16))):
        weights = np.zeros(256)
        weights[0], weights[columns] = 1.0, 3 * 2.0**-25
        row = torch.tensor(np.where(weights > 0, np.log(np.maximum(weights, 1e-300)), -200.0), dtype=torch.float32)[None]
        params = batch(1, temperature=1.0)
        for u in (1 - 2**-21, 1 - 2**-22, 1 - 2**-24):
            uniform = np.array([u], dtype=np.float32)
            drawn = compiled(row, params, uniform).token_ids.item()
            assert drawn == sampler._sample_in_passes(row, params, uniform).token_ids.item() and weights[drawn] > 0


def test_a_rows_draw_does_not_depend_on_a_neighbour_wanting_alternatives():
    # Every row goes through the compiled pass either way: the rows beside the one that wants
    # alternatives have the same tokens and logprobs to the bit as in a batch where none wants any,
    # and that row's draw is its own alone too.
    logits = random_logits(4, vocab=700, seed=5)
    rows = dict(temperature=[0.0, 0.8, 1.0, 0.5], top_p=[1.0, 0.9, 1.0, 1.0], top_k=[0, 0, 0, 20], seeds=[-1, 3, 4, 5], positions=range(4))
    alone = sample(logits, SamplingBatch.of(**rows))
    beside = sample(logits, SamplingBatch.of(**rows, num_logprobs=np.array([0, 0, 2, 0], dtype=np.uint8)))
    for r in (0, 1, 3):
        assert beside.token_ids[r] == alone.token_ids[r]
        assert beside.logprobs[r].item() == alone.logprobs[r].item()
    assert beside.top_ids is not None and beside.top_ids[2, 0] == int(torch.log_softmax(logits[2], dim=-1).argmax())
    assert alone.top_ids is None
    # The row that wants alternatives draws what it draws alone (its seed decides its uniform).
    lone = {name: [value[2]] for name, value in rows.items() if name != "positions"} | {"positions": [2]}
    by_itself = sample(logits[2:3], SamplingBatch.of(**lone, num_logprobs=np.array([2], dtype=np.uint8)))
    assert beside.token_ids[2] == by_itself.token_ids[0] and beside.logprobs[2].item() == by_itself.logprobs[0].item()
    assert torch.equal(beside.top_ids[2], by_itself.top_ids[0]) and torch.equal(beside.top_logprobs[2], by_itself.top_logprobs[0])


def test_the_compiled_pass_reads_the_draw_kinds_the_sampler_writes():
    import executor.sampler as sampler

    if sampler._sampling is None:
        pytest.skip("executor._sampling is not built here")
    for name in ("DRAW_GREEDY", "DRAW_PLAIN", "DRAW_CUT", "DRAW_ELSEWHERE"):
        assert getattr(sampler._sampling, name) == getattr(sampler, name), name
    host = batch(2).host
    with pytest.raises(ValueError, match="DRAW_"):
        sampler._sample_compiled(torch.zeros(2, 8), host, np.zeros(0, dtype=np.float32), np.array([0, 9], dtype=np.uint8))


def _compiled_rows(logits: torch.Tensor, host: HostRows, threads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]:
    """The compiled pass on up to `threads` threads, with every seventh row left as logits
    processing leaves it: tokens, logprobs, finite flags, rows left, alternatives' ids and logprobs."""
    import executor.sampler as sampler

    uniforms = np.random.default_rng(logits.shape[0]).random(host.random.shape[0], dtype=np.float32)
    draws = host.draws.copy()
    draws[np.arange(draws.shape[0]) % 7 == 6] = sampler.DRAW_ELSEWHERE
    out, left = sampler._sample_compiled(logits, host, uniforms, draws, threads)
    alternatives = out.top_ids.numpy(), out.top_logprobs.numpy()
    return out.token_ids.numpy(), out.logprobs.numpy(), out.finite.numpy(), 0 if left is None else left.shape[0], *alternatives


def _mixed_rows(rows: int, vocab: int) -> tuple[torch.Tensor, HostRows]:
    """Rows of every kind (greedy, plain, top-k, top-p, a flat top-p row drawn over its whole row, a
    non-finite one, some that want alternatives), over enough logits for the compiled pass to draw
    them on several threads."""
    logits = random_logits(rows, vocab=vocab, seed=rows) * 2
    logits[3] = 0.0
    logits[5, 17] = float("nan")
    kinds = [(0.0, 1.0, 0), (0.8, 1.0, 0), (0.7, 1.0, 40), (0.7, 0.9, 0), (1.0, 0.95, 0), (0.7, 0.9, 0), (0.7, 0.9, 0)]
    t, p, k = (np.array([kinds[r % len(kinds)][i] for r in range(rows)]) for i in range(3))
    wants = np.array([(0, 3, 0, 5, 2, 4, 0)[r % len(kinds)] for r in range(rows)], dtype=np.uint8)
    return logits, HostRows.of(t, p, k, np.full(rows, -1), np.arange(rows), wants)


def test_the_compiled_pass_draws_the_same_on_any_number_of_threads():
    # Threads claim rows as they go, so which thread draws a row changes from call to call; a row's
    # token, logprob, flag and alternatives are its own either way, and the rows left are the same.
    import executor.sampler as sampler

    if sampler._sampling is None:
        pytest.skip("executor._sampling is not built here")
    logits, host = _mixed_rows(24, 40000)
    alone = _compiled_rows(logits, host, 1)
    assert alone[3] == 3 and alone[0][6] == -1 and alone[0][3] >= 0 and alone[2][5] == 0
    for threads in (2, 3, 8, 64):
        for _ in range(5):
            got = _compiled_rows(logits, host, threads)
            assert np.array_equal(got[0], alone[0]) and got[3] == alone[3], threads
            assert np.array_equal(got[1], alone[1], equal_nan=True) and np.array_equal(got[2], alone[2]), threads
            assert np.array_equal(got[4], alone[4]) and np.array_equal(got[5], alone[5], equal_nan=True), threads
    with pytest.raises(ValueError, match="threads"):
        _compiled_rows(logits, host, 0)


def test_the_compiled_pass_takes_alternatives_buffers_of_its_exact_width():
    # A row's alternatives are written at a stride of `alternatives`: a wider buffer would hold them
    # in the wrong places, so it is refused, as a narrower one is.
    import executor.sampler as sampler

    if sampler._sampling is None:
        pytest.skip("executor._sampling is not built here")
    logits, host = _mixed_rows(7, 300)
    rows, width = 7, host.most_logprobs
    tokens, logprobs, finite = np.empty(rows, np.int64), np.empty(rows, np.float32), np.empty(rows, np.uint8)
    for columns in (width - 1, width + 1):
        with pytest.raises(ValueError):
            sampler._sampling.sample_rows(
                logits.numpy(), 300, host.scale, host.draws, host.top_k, host.top_p, np.zeros(rows, np.float32),
                sampler._FIRST_LOG_RATIO, sampler._LOG_MARGIN_32, sampler.CANDIDATE_RATIOS[0], 300, tokens, logprobs, finite,
                host.num_logprobs, width, np.zeros((rows, columns), np.int64), np.zeros((rows, columns), np.float32), 1,
            )  # fmt: skip


def test_the_compiled_pass_reads_a_tensor_by_its_address_as_it_reads_its_buffer():
    # sample() hands the compiled pass the logits' (address, rows), not a numpy view of them (change
    # 110): the same rows drawn either way, and an address that cannot be one refused.
    import executor.sampler as sampler

    if sampler._sampling is None:
        pytest.skip("executor._sampling is not built here")
    rows, vocab = 7, 300
    logits, host = _mixed_rows(rows, vocab)
    uniforms = np.random.default_rng(0).random(rows, dtype=np.float32)

    def draw(source: object) -> list[np.ndarray]:
        out = [np.full(rows, -2, np.int64), np.zeros(rows, np.float32), np.zeros(rows, np.uint8)]
        top = [np.zeros((rows, host.most_logprobs), np.int64), np.zeros((rows, host.most_logprobs), np.float32)]
        sampler._sampling.sample_rows(
            source, vocab, host.scale, host.draws, host.top_k, host.top_p, uniforms, sampler._FIRST_LOG_RATIO,
            sampler._LOG_MARGIN_32, sampler.CANDIDATE_RATIOS[0], vocab, *out, host.num_logprobs, host.most_logprobs, *top, 1,
        )  # fmt: skip
        return out + top

    by_buffer, by_address = draw(logits.numpy()), draw((logits.data_ptr(), rows))
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(by_buffer, by_address))
    assert (by_address[0] >= 0).all()
    for address in (0, -8):
        with pytest.raises(ValueError, match=f"address {address} for 7 rows"):
            draw((address, rows))
    for rows_given in (-1, 2**62):
        with pytest.raises(ValueError, match=f"{rows_given} rows, not 0 to"):
            draw((logits.data_ptr(), rows_given))
    with pytest.raises(TypeError):
        draw((logits.data_ptr(),))


def test_a_step_that_samples_no_row_draws_none_on_the_compiled_pass():
    # A prefill chunk that ends no prompt samples nothing: its (0, vocab) logits have address 0.
    none = SamplingBatch.of([], [], [], [], [])
    for into in (None, HostOutputs.frame(1, 0, 0)[0]):
        out = sample(torch.empty(0, 64), none, into)
        assert out.token_ids.shape == (0,) and out.logprobs.shape == (0,)


@pytest.mark.parametrize("kind", ["float16", "strided", "meta", "negative"])
def test_the_compiled_pass_refuses_logits_its_address_would_misread(kind: str):
    # Read by address, the logits are checked in Python where a buffer's checks would have refused
    # them: half-width floats would be read past their end, a strided view in the wrong places.
    import executor.sampler as sampler

    if sampler._sampling is None:
        pytest.skip("executor._sampling is not built here")
    logits, host = _mixed_rows(7, 64)
    made = {
        "float16": lambda: logits.half(), "strided": lambda: logits.t().contiguous().t(), "meta": lambda: logits.to("meta"),
        "negative": lambda: torch._neg_view(logits),  # its memory holds the values' negatives
    }  # fmt: skip
    logits = made[kind]()
    with pytest.raises(TypeError, match="contiguous float32 logits in the host's memory"):
        sampler._sample_compiled(logits, host, np.zeros(host.random.shape[0], np.float32), host.draws)


def _helpers_draw(logits: torch.Tensor, host: HostRows, expected: np.ndarray, within_s: float = 60.0) -> bool:
    """Whether the helper threads draw rows in two-thread calls made for up to `within_s`, each
    drawing what one thread draws (a helper woken too late for every row of a call draws none of
    it, so a loaded machine may need many calls)."""
    import time

    import executor.sampler as sampler

    before, deadline = sampler._sampling.pool_stats()[1], time.monotonic() + within_s
    while time.monotonic() < deadline:
        assert np.array_equal(_compiled_rows(logits, host, 2)[0], expected)
        if sampler._sampling.pool_stats()[1] > before:
            return True
    return False


def test_the_compiled_pass_on_two_callers_at_once_and_in_a_forked_child():
    # The helper threads serve one call at a time (the others draw alone) and do draw rows; a child
    # forked while other threads are drawing has none of them, nor the pool's state: it starts its own.
    import multiprocessing
    import os
    import threading

    import executor.sampler as sampler

    if sampler._sampling is None:
        pytest.skip("executor._sampling is not built here")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: no helper threads")
    logits, host = _mixed_rows(48, 40000)
    expected = _compiled_rows(logits, host, 1)[0]
    assert _helpers_draw(logits, host, expected)
    wrong: list[int] = []
    stop = threading.Event()

    def call() -> None:
        while not stop.is_set():
            if not np.array_equal(_compiled_rows(logits, host, 2)[0], expected):
                wrong.append(1)

    callers = [threading.Thread(target=call, daemon=True) for _ in range(3)]
    child = multiprocessing.get_context("fork").Process(target=_exit_with_draw_check, args=(logits, host, expected))
    try:
        for caller in callers:
            caller.start()
        child.start()  # forked while the callers draw, one of them most likely on the helpers
        child.join(timeout=120)
        assert child.exitcode == 0
    finally:
        stop.set()
        if child.is_alive():
            child.kill()
            child.join()
        for caller in callers:
            caller.join(timeout=60)
    assert not any(caller.is_alive() for caller in callers) and not wrong


def _exit_with_draw_check(logits: torch.Tensor, host: HostRows, expected: np.ndarray) -> None:
    import os

    import executor.sampler as sampler

    fresh = sampler._sampling.pool_stats() == (0, 0)
    os._exit(0 if fresh and _helpers_draw(logits, host, expected) and sampler._sampling.pool_stats()[0] == 1 else 1)


@pytest.mark.parametrize("width", [0, 3])
def test_outputs_made_ahead_take_the_same_sample_and_are_what_it_returns(width: int) -> None:
    """A step's HostOutputs, made where it is staged: the compiled pass writes the sample there, the
    same as into arrays of its own (seeded and greedy rows, so both samples draw alike), and a
    non-finite row as well."""
    import executor.sampler as sampler

    if sampler._sampling is None:
        pytest.skip("executor/_sampling.c is not built: the passes make outputs of their own")
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 3
    logits[2] = float("nan")
    params = SamplingBatch.of(
        [0.0, 0.7, 1.0, 0.5, 0.0, 1.3], [1.0, 0.9, 1.0, 0.5, 1.0, 1.0], [0, 0, 5, 0, 0, 0], [-1, 3, 4, 8, -1, 6], range(6),
        num_logprobs=np.full(6, width, dtype=np.uint8),
    )  # fmt: skip
    expected = sample(logits, params)
    into, other = HostOutputs.frame(2, 6, width)
    got = sample(logits, params, into)
    assert got is into.out
    for name in ("token_ids", "logprobs", "finite", "top_ids", "top_logprobs"):
        want, have = getattr(expected, name), getattr(got, name)
        assert (want is None) == (have is None) == (width == 0 and name.startswith("top")), name
        if want is not None:
            torch.testing.assert_close(have, want, equal_nan=True, rtol=0, atol=0)
    assert np.array_equal(into.tokens, expected.token_ids.numpy())
    assert other.out.token_ids.data_ptr() != got.token_ids.data_ptr()  # each forward its own row
    # The RESULT's host copy read from the arrays where the pass wrote them, and only there.
    from executor.steps import sampled_to_host

    direct, read = sampled_to_host(expected), sampled_to_host(got, into)
    other.tokens[:] = -5
    elsewhere = sampled_to_host(expected, other)
    for host in (read, elsewhere):
        for name in ("tokens", "finite", "logprobs", "top_ids", "top_logprobs"):
            want, have = getattr(direct, name), getattr(host, name)
            assert (want is None and have is None) or (np.array_equal(want, have, equal_nan=True) and want.dtype == have.dtype), name
    for rows, alternatives in ((5, width), (6, width + 1)):
        with pytest.raises(SamplingError, match=f"outputs made for {rows} rows of {alternatives} alternatives"):
            sample(logits, params, HostOutputs.frame(1, rows, alternatives)[0])
