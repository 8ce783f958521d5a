"""paged_attention against a per-sequence, per-head reference, and its promise to the clearing rule:
a NaN left in any gathered slot, masked or not, reaches the output (0 x NaN is NaN)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.inputs import StepInputs
from executor.model.attention import AttentionMasks, paged_attention
from protocol.frames import Prepare

PAGE = 4
Q_HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8
NUM_PAGES = 12
PAD = NUM_PAGES  # the cache's extra last page


def _prepare(query_lens: list[int], context_lens: list[int], tables: list[list[int]]) -> Prepare:
    n = len(query_lens)
    positions = [p for q, c in zip(query_lens, context_lens) for p in range(c - q, c)]
    i32 = lambda values: np.asarray(values, dtype=np.int32)  # noqa: E731
    return Prepare(
        seq_ids=np.arange(n, dtype=np.int64),
        query_lens=i32(query_lens),
        context_lens=i32(context_lens),
        token_ids=i32([1] * len(positions)),
        positions=i32(positions),
        page_table_base=i32([0] * n),
        page_table_lens=i32([len(t) for t in tables]),
        page_table=i32([p for t in tables for p in t]),
        sample=np.ones(n, dtype=np.uint8),
        temperature=np.zeros(n, dtype=np.float32),
        top_p=np.ones(n, dtype=np.float32),
        top_k=np.zeros(n, dtype=np.int32),
        seeds=np.full(n, -1, dtype=np.int64),
        cleared_pages=i32([]),
        restore_pages=i32([]),
        restore_slots=i32([]),
        offload_pages=i32([]),
        offload_slots=i32([]),
        poison_pages=i32([]),
    )


def _run(prepare: Prepare, k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor):
    inputs = StepInputs.from_prepare(prepare, pad_page=PAD, page_size=PAGE, device="cpu")
    masks = AttentionMasks.build(inputs, Q_HEADS, KV_HEADS, PAGE, torch.float32, torch.device("cpu"))
    return paged_attention(q, k_cache, v_cache, inputs, masks)


def _reference(prepare: Prepare, k_cache, v_cache, q) -> torch.Tensor:
    """Each sequence, each query head, over exactly the slots at or before its token's position."""
    rows, start = [], 0
    table_start = np.concatenate(([0], np.cumsum(prepare.page_table_lens)))
    for s, length in enumerate(prepare.query_lens.tolist()):
        table = prepare.page_table[table_start[s] : table_start[s + 1]].tolist()
        k = torch.cat([k_cache[p] for p in table])  # [slots, Hkv, D]
        v = torch.cat([v_cache[p] for p in table])
        for t in range(start, start + length):
            visible = int(prepare.positions[t]) + 1
            heads = []
            for h in range(Q_HEADS):
                kv = h // (Q_HEADS // KV_HEADS)
                scores = (k[:visible, kv] @ q[t, h]) * HEAD_DIM**-0.5
                heads.append(torch.softmax(scores, 0) @ v[:visible, kv])
            rows.append(torch.cat(heads))
        start += length
    return torch.stack(rows)


def _cache(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_PAGES + 1, PAGE, KV_HEADS, HEAD_DIM)
    k, v = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    k[PAD], v[PAD] = 0, 0
    return k, v


DECODE = ([1, 1, 1], [7, 2, 11], [[3, 5], [0], [8, 9, 1]])
PREFILL = ([5, 3], [5, 9], [[2, 4], [6, 7, 11]])  # the second on top of 6 cached tokens
# Decodes around a prefill chunk: the one-token sequences take the batched path, with a table
# narrower than the prefill's.
MIXED = ([1, 6, 1], [3, 10, 6], [[0], [2, 4, 9], [5, 11]])
STEPS = pytest.mark.parametrize("step", [DECODE, PREFILL, MIXED], ids=["decode", "prefill", "mixed"])


@STEPS
def test_matches_the_per_head_reference(step):
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = _cache(g)
    prepare = _prepare(*step)
    q = torch.randn(int(prepare.query_lens.sum()), Q_HEADS, HEAD_DIM, generator=g)
    torch.testing.assert_close(
        _run(prepare, k_cache, v_cache, q), _reference(prepare, k_cache, v_cache, q), rtol=1e-5, atol=1e-5
    )


@STEPS
@pytest.mark.parametrize("tensor", ["k", "v"])
def test_nan_past_the_end_of_a_sequence_reaches_its_output(step, tensor):
    """The slot after the last token of the last sequence is masked for every row, and read."""
    g = torch.Generator().manual_seed(2)
    k_cache, v_cache = _cache(g)
    prepare = _prepare(*step)
    q = torch.randn(int(prepare.query_lens.sum()), Q_HEADS, HEAD_DIM, generator=g)
    clean = _run(prepare, k_cache, v_cache, q)
    last_page = int(prepare.page_table[-1])
    tail_slot = int(prepare.context_lens[-1]) % PAGE
    assert tail_slot != 0, "the case must leave a masked slot in the last page"
    (k_cache if tensor == "k" else v_cache)[last_page, tail_slot] = float("nan")
    poisoned = _run(prepare, k_cache, v_cache, q)
    last_rows = slice(int(prepare.query_lens[:-1].sum()), None)
    assert torch.isnan(poisoned[last_rows]).all()
    torch.testing.assert_close(poisoned[: last_rows.start], clean[: last_rows.start])
