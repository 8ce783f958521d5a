"""Paged attention that reads whole pages, as the fast kernels do.

Every slot of every page in a sequence's page table is gathered (including the slots past its
length in the last page, and pad pages) and excluded only by a -inf score. The softmax weight of
such a slot is then exactly 0, and 0 x NaN is NaN: stale or uninitialized bytes in V poison the
output. That is deliberate; the runtime's clearing rule is what keeps those bytes zero, and the
poison tests depend on this kernel being able to see a violation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.inputs import StepInputs


@dataclass
class AttentionMasks:
    """The step's masks, the same for every layer, so built once per step.

    decode_bias: [n, Hq, S * Hkv] of 0 and -inf in the compute dtype, for the folded decode below.
    prefill: per sequence with new tokens, (first row, last row + 1, bool [1, 1, 1, L, S] masked).
    """

    decode_bias: torch.Tensor | None
    prefill: list[tuple[int, int, torch.Tensor]]

    @classmethod
    def build(
        cls,
        inputs: StepInputs,
        q_heads: int,
        kv_heads: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> AttentionMasks:
        slots = inputs.page_table.shape[1] * page_size
        if inputs.is_decode:
            # Column c of a folded row is slot c // Hkv of KV head c % Hkv; query head h reads KV
            # head h // group. Masking the other heads' columns leaves each head's softmax as if
            # over its own S slots.
            column = torch.arange(slots * kv_heads, device=device)
            slot, head = column // kv_heads, column % kv_heads
            q_head = torch.arange(q_heads, device=device) // (q_heads // kv_heads)
            masked = (slot[None, None, :] >= inputs.context_lens[:, None, None]) | (
                head[None, None, :] != q_head[None, :, None]
            )
            bias = torch.zeros(masked.shape, dtype=dtype, device=device)
            return cls(bias.masked_fill_(masked, float("-inf")), [])
        prefill, start = [], 0
        slot = torch.arange(slots, device=device)
        for length in inputs.query_lens_host.tolist():
            if length:
                stop = start + length
                masked = slot[None, :] > inputs.positions[start:stop, None]
                prefill.append((start, stop, masked.view(1, 1, 1, length, slots)))
                start = stop
            else:
                prefill.append((start, start, slot[:0]))
        return cls(None, prefill)


def _gather_pages(
    cache: torch.Tensor, page_table: torch.Tensor, dtype: torch.dtype, kv_scale: float
) -> torch.Tensor:
    """[B, W] page ids -> [B, W * page_size * H, D]: token-major, heads fastest, as stored.

    index_select copies whole pages (advanced indexing, cache[page_table], is ~9x slower here);
    the view after it is free.
    """
    pages = cache.index_select(0, page_table.reshape(-1))
    pages = pages.view(page_table.shape[0], -1, cache.shape[-1])
    if cache.dtype == torch.float8_e4m3fn:
        return pages.to(dtype).mul_(kv_scale)
    return pages.to(dtype)


def _head_major(tokens: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, S * H, D] -> contiguous [B, H, S, D], one copy: the score matmul then reads K
    transposed and the value matmul reads V as they are."""
    batch, rows, head_dim = tokens.shape
    return tokens.view(batch, rows // kv_heads, kv_heads, head_dim).transpose(1, 2).contiguous()


def _decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """q [n, Hq, D], k/v [n, S * Hkv, D] as gathered, bias [n, Hq, S * Hkv] -> [n, Hq, D].

    Every query head is scored against every KV head's slots and the wrong heads are masked off
    (the bias). That costs Hkv times the score arithmetic but no copy of K or V into head-major
    order, which at decode (one row per head) is what the step pays for: a batch-32 SmolLM2 step's
    attention took half the time this way.
    """
    scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=sm_scale).float()
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.bmm(probs, v)


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """q [1, Hkv, G, L, D], k/v [1, Hkv, S, D], masked [1, 1, 1, L, S] -> [1, Hkv, G, L, D].

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
    masks: AttentionMasks,
    *,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """q: [T, Hq, D] (already rotated; this step's K/V already written) -> [T, Hq * D]."""
    num_tokens, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[-2]
    group = q_heads // kv_heads
    sm_scale = head_dim**-0.5
    dtype = q.dtype
    if masks.decode_bias is not None:
        k = _gather_pages(k_cache, inputs.page_table, dtype, kv_scale)
        v = _gather_pages(v_cache, inputs.page_table, dtype, kv_scale)
        out = _decode(q, k, v, masks.decode_bias, sm_scale)
        return out.view(num_tokens, q_heads * head_dim)

    out = torch.empty(num_tokens, q_heads * head_dim, dtype=dtype, device=q.device)
    for seq, (start, stop, masked) in enumerate(masks.prefill):
        if start == stop:
            continue
        length = stop - start
        table = inputs.page_table[seq : seq + 1]
        k = _head_major(_gather_pages(k_cache, table, dtype, kv_scale), kv_heads)
        v = _head_major(_gather_pages(v_cache, table, dtype, kv_scale), kv_heads)
        query = q[start:stop].view(length, kv_heads, group, head_dim).permute(1, 2, 0, 3)[None]
        attended = _prefill(query, k, v, masked, sm_scale)
        out[start:stop] = attended[0].permute(2, 0, 1, 3).reshape(length, q_heads * head_dim)
    return out
