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
import torch.nn.functional as F

from executor.inputs import StepInputs


@dataclass
class AttentionMasks:
    """The step's additive masks (0 or -inf, in the compute dtype), the same for every layer, so
    built once per step.

    decode: [n, 1, Hq, S * Hkv] for the folded decode below.
    prefill: per sequence, (first row, last row + 1, [G * L, S]); rows are a KV head's G query
    heads one after another, each over the sequence's L new tokens.
    """

    decode: torch.Tensor | None
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
        group = q_heads // kv_heads
        if inputs.is_decode:
            # Column c of a folded row is slot c // Hkv of KV head c % Hkv; query head h reads KV
            # head h // group. Masking the other heads' columns leaves each head's softmax as if
            # over its own S slots.
            column = torch.arange(slots * kv_heads, device=device)
            slot, head = column // kv_heads, column % kv_heads
            q_head = torch.arange(q_heads, device=device) // group
            masked = (slot[None, None, :] >= inputs.context_lens[:, None, None]) | (
                head[None, None, :] != q_head[None, :, None]
            )
            return cls(_bias(masked, dtype)[:, None], [])
        prefill, start = [], 0
        slot = torch.arange(slots, device=device)
        for length in inputs.query_lens_host.tolist():
            stop = start + length
            masked = slot[None, :] > inputs.positions[start:stop, None]
            prefill.append((start, stop, _bias(masked, dtype).repeat(group, 1)))
            start = stop
        return cls(None, prefill)


def _bias(masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill_(
        masked, float("-inf")
    )


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
    """[1, S * H, D] -> contiguous [1, H, S, D]."""
    batch, rows, head_dim = tokens.shape
    return tokens.view(batch, rows // kv_heads, kv_heads, head_dim).transpose(1, 2).contiguous()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    inputs: StepInputs,
    masks: AttentionMasks,
    *,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """q: [T, Hq, D] (already rotated; this step's K/V already written) -> [T, Hq * D].

    Both paths call torch's fused attention with an explicit additive mask, never is_causal or a
    kernel that skips masked blocks: every gathered slot is multiplied in, so a NaN left in a
    masked slot still reaches the output (tests/model/test_attention.py holds torch to that).
    """
    num_tokens, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[-2]
    group = q_heads // kv_heads
    dtype = q.dtype
    if masks.decode is not None:
        # Decode: every query head is scored against every KV head's slots as gathered
        # ([n, S * Hkv, D]) and the mask removes the other heads' columns. That is Hkv times the
        # score arithmetic but no copy of K and V into head-major order, which is what a decode
        # step's attention pays for: it halved a batch-32 SmolLM2 step's attention.
        k = _gather_pages(k_cache, inputs.page_table, dtype, kv_scale)[:, None]
        v = _gather_pages(v_cache, inputs.page_table, dtype, kv_scale)[:, None]
        out = F.scaled_dot_product_attention(q[:, None], k, v, attn_mask=masks.decode)
        return out.view(num_tokens, q_heads * head_dim)

    out = torch.empty(num_tokens, q_heads * head_dim, dtype=dtype, device=q.device)
    for seq, (start, stop, bias) in enumerate(masks.prefill):
        if start == stop:
            continue
        length = stop - start
        table = inputs.page_table[seq : seq + 1]
        k = _head_major(_gather_pages(k_cache, table, dtype, kv_scale), kv_heads)
        v = _head_major(_gather_pages(v_cache, table, dtype, kv_scale), kv_heads)
        # A KV head's G query heads folded into the rows of one call: broadcasting K over G
        # would copy it G times.
        rows = q[start:stop].view(length, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        rows = rows.reshape(1, kv_heads, group * length, head_dim)
        attended = F.scaled_dot_product_attention(rows, k, v, attn_mask=bias)
        out[start:stop] = attended.view(kv_heads, group, length, head_dim).permute(2, 0, 1, 3).reshape(
            length, q_heads * head_dim
        )
    return out
