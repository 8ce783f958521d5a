"""Paged attention that reads whole pages, as the fast kernels do.

Every slot of every page in a sequence's page table is gathered (including the slots past its
length in the last page, and pad pages) and excluded only by a -inf score. The softmax weight of
such a slot is then exactly 0, and 0 x NaN is NaN: stale or uninitialized bytes in V poison the
output. That is deliberate; the runtime's clearing rule is what keeps those bytes zero, and the
poison tests depend on this kernel being able to see a violation.
"""

from __future__ import annotations

import torch

from executor.inputs import StepInputs


def _gather_pages(
    cache: torch.Tensor, page_table: torch.Tensor, dtype: torch.dtype, kv_scale: float
) -> torch.Tensor:
    """[B, W] page ids -> contiguous [B, H, W * page_size, D] in the compute dtype.

    Head-major and contiguous in one copy, so that the score matmul reads K transposed and the
    value matmul reads V as they are, without copying either again (that was a third of a
    batch-32 decode step).
    """
    # index_select copies whole pages; advanced indexing (cache[page_table]) is ~9x slower here.
    pages = cache.index_select(0, page_table.reshape(-1))
    pages = pages.view(page_table.shape[0], -1, *cache.shape[-2:]).transpose(1, 2)
    out = torch.empty(pages.shape, dtype=dtype, device=pages.device)
    out.copy_(pages)
    return out.mul_(kv_scale) if cache.dtype == torch.float8_e4m3fn else out


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """q [B, Hkv, G, L, D], k/v [B, Hkv, S, D], masked [B, 1, 1, L, S] -> [B, Hkv, G, L, D].

    A KV head's G query heads are folded into the rows of one matmul: broadcasting K over G would
    copy it G times.
    """
    batch, kv_heads, group, length, head_dim = q.shape
    rows = q.reshape(batch, kv_heads, group * length, head_dim)
    scores = torch.matmul(rows, k.transpose(-1, -2)).float().mul_(sm_scale)
    scores.view(batch, kv_heads, group, length, -1).masked_fill_(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(batch, kv_heads, group, length, head_dim)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    inputs: StepInputs,
    *,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """q: [T, Hq, D] (already rotated; this step's K/V already written) -> [T, Hq * D]."""
    num_tokens, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[-2]
    group = q_heads // kv_heads
    sm_scale = head_dim**-0.5
    dtype = q.dtype
    if inputs.is_decode:
        n = inputs.num_seqs
        k = _gather_pages(k_cache, inputs.page_table, dtype, kv_scale)
        v = _gather_pages(v_cache, inputs.page_table, dtype, kv_scale)
        slots = torch.arange(k.shape[2], device=q.device)
        masked = (slots[None, :] >= inputs.context_lens[:, None]).view(n, 1, 1, 1, -1)
        out = _attend(q.view(n, kv_heads, group, 1, head_dim), k, v, masked, sm_scale)
        return out.reshape(num_tokens, q_heads * head_dim)

    out = torch.empty(num_tokens, q_heads * head_dim, dtype=dtype, device=q.device)
    start = 0
    for seq, length in enumerate(inputs.query_lens_host.tolist()):
        if length == 0:
            continue
        stop = start + length
        table = inputs.page_table[seq : seq + 1]
        k = _gather_pages(k_cache, table, dtype, kv_scale)
        v = _gather_pages(v_cache, table, dtype, kv_scale)
        slots = torch.arange(k.shape[2], device=q.device)
        masked = slots[None, :] > inputs.positions[start:stop, None]
        query = q[start:stop].view(length, kv_heads, group, head_dim).permute(1, 2, 0, 3)[None]
        attended = _attend(query, k, v, masked.view(1, 1, 1, length, -1), sm_scale)
        out[start:stop] = attended[0].permute(2, 0, 1, 3).reshape(length, q_heads * head_dim)
        start = stop
    return out
