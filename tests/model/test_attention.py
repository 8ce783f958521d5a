"""paged_attention against a per-sequence, per-head reference, and its promise to the clearing rule:
a NaN left in any gathered slot, masked or not, reaches the output (0 x NaN and NaN + -inf are NaN).

The cuda cases exist where a GPU is (scripts/device_check.sh runs them); CI has none."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.inputs import StepInputs
from executor.model.attention import AttentionMasks, paged_attention
from protocol.frames import Prepare

PAGE = 4
HEAD_DIM = 8
NUM_PAGES = 160
PAD = NUM_PAGES  # the cache's extra last page

DEVICES = pytest.mark.parametrize("device", ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
# (query heads, KV heads) of one rank: SmolLM2's 2 groups of 3, a rank holding one KV head shared
# with others, and no grouping.
HEADS = pytest.mark.parametrize("heads", [(6, 2), (3, 1), (2, 1), (4, 4)], ids=lambda h: f"{h[0]}q{h[1]}kv")

DECODE = ([1, 1, 1], [7, 2, 11], [[3, 5], [0], [8, 9, 1]])
PREFILL = ([5, 3], [5, 9], [[2, 4], [6, 7, 11]])  # the second on top of 6 cached tokens
# Decodes around a prefill chunk: the one-token sequences take the batched path, with a table
# narrower than the prefill's.
MIXED = ([1, 6, 1], [3, 10, 6], [[0], [2, 4, 9], [5, 11]])
# A table of 600 slots: the CPU kernel splits keys into blocks of 512, so a whole block is masked.
LONG = ([3], [599], [list(range(5, 5 + 150))])
STEPS = pytest.mark.parametrize(
    "step", [DECODE, PREFILL, MIXED, LONG], ids=["decode", "prefill", "mixed", "long"]
)


def _prepare(query_lens: list[int], context_lens: list[int], tables: list[list[int]]) -> Prepare:
    return Prepare.greedy(
        query_lens, context_lens, [1] * sum(query_lens), [len(t) for t in tables], [p for t in tables for p in t]
    )


class Case:
    def __init__(
        self, step, heads, device: str, dtype: torch.dtype = torch.float32, storage: torch.dtype | None = None
    ):
        self.prepare = _prepare(*step)
        self.q_heads, self.kv_heads = heads
        self.device, self.dtype = torch.device(device), dtype
        g = torch.Generator().manual_seed(1)
        # A one-layer cache as KVCache lays it out; k and v are views of its two planes.
        shape = (NUM_PAGES + 1, 1, 2, PAGE, self.kv_heads, HEAD_DIM)
        self.kv = torch.randn(shape, generator=g).to(device, storage or dtype)
        self.k, self.v = self.kv[:, 0, 0], self.kv[:, 0, 1]
        self.k[PAD], self.v[PAD] = 0, 0
        rows = int(self.prepare.query_lens.sum())
        self.q = torch.randn(rows, self.q_heads, HEAD_DIM, generator=g).to(device, dtype)

    def run(self) -> torch.Tensor:
        inputs = StepInputs.from_prepare(self.prepare, pad_page=PAD, page_size=PAGE, device=self.device)
        masks = AttentionMasks.build(inputs, self.q_heads, self.kv_heads, PAGE, self.dtype, self.device)
        layer, scales = torch.zeros(1, dtype=torch.long, device=self.device), torch.ones(1, 2, device=self.device)
        return paged_attention(self.q, self.kv, layer, scales, masks).float().cpu()

    def reference(self) -> torch.Tensor:
        """Each sequence, each query head, over exactly the slots at or before its token's position."""
        p, rows, start = self.prepare, [], 0
        table_start = np.concatenate(([0], np.cumsum(p.page_table_lens)))
        k_cache, v_cache, q = self.k.float().cpu(), self.v.float().cpu(), self.q.float().cpu()
        for s, length in enumerate(p.query_lens.tolist()):
            table = p.page_table[table_start[s] : table_start[s + 1]].tolist()
            k = torch.cat([k_cache[page] for page in table])  # [slots, Hkv, D]
            v = torch.cat([v_cache[page] for page in table])
            for t in range(start, start + length):
                visible = int(p.positions[t]) + 1
                heads = []
                for h in range(self.q_heads):
                    kv = h // (self.q_heads // self.kv_heads)
                    scores = (k[:visible, kv] @ q[t, h]) * HEAD_DIM**-0.5
                    heads.append(torch.softmax(scores, 0) @ v[:visible, kv])
                rows.append(torch.cat(heads))
            start += length
        return torch.stack(rows)


@DEVICES
@HEADS
@STEPS
def test_matches_the_per_head_reference(step, heads, device):
    case = Case(step, heads, device)
    torch.testing.assert_close(case.run(), case.reference(), rtol=1e-5, atol=1e-5)


@DEVICES
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_matches_the_reference(dtype, device):
    case = Case(MIXED, (6, 2), device, dtype)
    torch.testing.assert_close(case.run(), case.reference(), rtol=2e-2, atol=2e-2)


def _poison_tail(case: Case, seq: int, tensor: str) -> slice:
    """NaN in the slot just past sequence `seq`'s last token (masked for all its rows); its rows."""
    p = case.prepare
    table_start = np.concatenate(([0], np.cumsum(p.page_table_lens)))
    context = int(p.context_lens[seq])
    assert context % PAGE, "the case must leave a masked slot in the sequence's last page"
    page = int(p.page_table[table_start[seq] + context // PAGE])
    (case.k if tensor == "k" else case.v)[page, context % PAGE] = float("nan")
    row_start = int(p.query_lens[:seq].sum())
    return slice(row_start, row_start + int(p.query_lens[seq]))


@DEVICES
@HEADS
@STEPS
@pytest.mark.parametrize("tensor", ["k", "v"])
@pytest.mark.parametrize(
    "dtype, storage",
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.float8_e4m3fn)],
    ids=["fp32", "bf16", "fp8-cache"],
)
def test_nan_past_the_end_of_a_sequence_reaches_its_rows_only(step, heads, tensor, dtype, storage, device):
    case = Case(step, heads, device, dtype, storage)
    clean = case.run()
    for seq in range(len(step[0])):
        if step[1][seq] % PAGE == 0:
            continue
        poisoned_case = Case(step, heads, device, dtype, storage)
        rows = _poison_tail(poisoned_case, seq, tensor)
        poisoned = poisoned_case.run()
        assert torch.isnan(poisoned[rows]).all()
        others = torch.ones(poisoned.shape[0], dtype=torch.bool)
        others[rows] = False
        torch.testing.assert_close(poisoned[others], clean[others])
