"""Paged attention that reads whole pages, as the fast kernels do.

Every slot of every page in a decoding sequence's page table is gathered (including the slots
past its length in the last page, and pad pages) and excluded only by a -inf score. The softmax
weight of such a slot is then exactly 0, and 0 x NaN is NaN: stale or uninitialized bytes in V
poison the output (in K too: NaN + -inf is NaN). That is deliberate; the runtime's clearing rule is
what keeps those bytes zero, and the poison tests depend on this kernel being able to see a
violation.

A prefill chunk on the CPU skips work that is masked anyway (DESIGN.md allows it): its causal
upper triangle is never computed. The slots of its last page past the chunk's end are still read
and added in with weight exp(-inf) = 0, so a NaN left there reaches the chunk's rows too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from executor.cache import from_storage
from executor.inputs import StepInputs


@dataclass
class Prefill:
    """One sequence bringing several new tokens: rows [start, stop) of the step."""

    start: int
    stop: int
    past: int  # tokens of its context before this chunk: the chunk's first position
    table: torch.Tensor  # [1, W]: its pages covering its context
    # [G * L, W * page_size] additive mask, a KV head's G query heads in turn, L rows each: only
    # where the kernel that skips the upper triangle does not run (CUDA).
    bias: torch.Tensor | None


@dataclass
class AttentionMasks:
    """What attention needs beyond the cache, the same for every layer of one attention window, so
    built once per step and window.

    Every sequence with one new token (decodes, and a prefill's one-token last chunk) goes through
    one batched call, so that a step mixing a prefill chunk into 31 decodes loops over one
    sequence in Python, not 32. Masks are additive (0 or -inf) in the compute dtype.
    """

    batched_rows: torch.Tensor | None  # rows of the one-token sequences; None: every row
    batched_table: torch.Tensor  # [d, W] their page tables
    batched_bias: torch.Tensor | None  # float32 [d, Hq, W * page_size * Hkv]; None: no such sequence
    prefill: list[Prefill]

    @classmethod
    def build(
        cls,
        inputs: StepInputs,
        q_heads: int,
        kv_heads: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        window: int | None = None,
    ) -> AttentionMasks:
        """window: a query sees only the last `window` positions, itself included (Mistral's
        sliding window): older slots are masked like the ones past the end, still read whole."""
        query_lens = inputs.query_lens_host
        group = q_heads // kv_heads
        if inputs.is_decode:
            rows, table, context = None, inputs.page_table, inputs.context_lens
        else:
            # In a mixed step each sequence is gathered over its own pages only, not over the
            # step's widest table.
            pages = -(-inputs.context_lens_host // page_size)
            seqs = np.flatnonzero(query_lens == 1)
            starts = np.concatenate(([0], np.cumsum(query_lens)[:-1]))
            width = int(pages[seqs].max()) if seqs.size else 0
            index = torch.from_numpy(seqs).to(device)
            rows = torch.from_numpy(starts[seqs]).to(device)
            table = inputs.page_table[index, :width]
            context = inputs.context_lens[index]
        bias = None
        if table.shape[0]:
            bias = decode_bias(context, table.shape[1] * page_size, q_heads, kv_heads, window)
        prefill = []
        if not inputs.is_decode:
            start = 0
            for seq, length in enumerate(query_lens.tolist()):
                if length > 1:
                    width, past = int(pages[seq]), int(inputs.context_lens_host[seq]) - length
                    own_table = inputs.page_table[seq : seq + 1, :width]
                    bias_rows = None
                    # The CPU's causal fast path has no window: a windowed chunk takes the mask.
                    if device.type != "cpu" or window is not None:
                        positions = inputs.positions[start : start + length]
                        bias_rows = chunk_bias(positions, width * page_size, window, dtype, group)
                    prefill.append(Prefill(start, start + length, past, own_table, bias_rows))
                start += length
        return cls(rows, table, bias, prefill)


def chunk_bias(
    positions: torch.Tensor, slots: int, window: int | None, dtype: torch.dtype, group: int
) -> torch.Tensor:
    """[G * L, slots] additive mask of a prefill chunk whose rows sit at `positions` [L]: a row
    reads the slots up to its own position (and, with a window, the last `window` of them); the
    rows repeat for each of a KV head's G query heads, as masked_chunk_attention folds them."""
    slot = torch.arange(slots, device=positions.device)
    masked = slot[None, :] > positions[:, None]
    if window is not None:
        masked = masked | (slot[None, :] <= positions[:, None] - window)
    bias = torch.zeros(masked.shape, dtype=dtype, device=positions.device).masked_fill(masked, float("-inf"))
    return bias.repeat(group, 1)


def _head_major(tokens: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[1, S * H, D] -> contiguous [1, H, S, D]: a prefill chunk's many rows per head amortize
    this copy, and the fused kernel wants each head's slots contiguous."""
    batch, rows, head_dim = tokens.shape
    return tokens.view(batch, rows // kv_heads, kv_heads, head_dim).transpose(1, 2).contiguous()


def paged_attention(
    q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, scales: torch.Tensor, masks: AttentionMasks
) -> torch.Tensor:
    """q: [T, Hq, D] (already rotated; this step's K/V already written) -> [T, Hq * D], over the
    whole cache `kv` (layer: long[1]; scales: the cache's [layers, 2], which an fp8 cache's K and V
    are multiplied by as they are read).

    Decoding rows go through `decode_attention` (an explicit additive mask, every gathered slot
    multiplied in, so a NaN left in a masked slot still reaches the output); a prefill chunk through
    the causal kernel and the rest of its last page (tests/model/test_attention.py holds both)."""
    num_tokens, q_heads, head_dim = q.shape
    dtype = q.dtype
    if masks.batched_rows is None:
        return decode_attention(q, kv, layer, masks.batched_table, masks.batched_bias, scales)

    out = torch.empty(num_tokens, q_heads * head_dim, dtype=dtype, device=q.device)
    if masks.batched_bias is not None:
        rows = masks.batched_rows
        out[rows] = decode_attention(q[rows], kv, layer, masks.batched_table, masks.batched_bias, scales)
    k_scale, v_scale = scales[layer][0]
    for p in masks.prefill:
        k, v = gather_kv(kv, layer, p.table)
        k, v = from_storage(k, k_scale, dtype), from_storage(v, v_scale, dtype)
        rows = q[p.start : p.stop]
        if p.bias is None:
            out[p.start : p.stop] = _chunk_attention(rows, k, v, p, kv.shape[-2])
        else:
            out[p.start : p.stop] = masked_chunk_attention(rows, k, v, p.bias, kv.shape[-2])
    return out


def _chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: Prefill, kv_heads: int
) -> torch.Tensor:
    """One prefill chunk on the CPU: q [L, Hq, D], its pages' K and V [1, S * Hkv, D] -> [L, Hq * D].

    Three parts, merged by their log-sum-exps: the chunk's own keys with the fused kernel's causal
    mode (which skips the blocks above the diagonal: half the work of a whole prefill), the keys
    before the chunk (all visible, no mask), and the rest of the last page (masked for every row,
    so weight exp(-inf) = 0: computed, small, to keep a NaN there visible).
    """
    length, q_heads, head_dim = q.shape
    slots, group = k.shape[1] // kv_heads, q_heads // kv_heads
    end = p.past + length
    # [Hkv, G, L, D] as a view: the kernel's output comes back in the same [L, Hkv, G, D] order.
    rows = q.view(length, kv_heads, group, head_dim).permute(1, 2, 0, 3)
    # K and V head-major and contiguous, broadcast over each KV head's G query heads: with strided
    # keys the kernel ran 2x slower on two threads.
    keys = _head_major(k, kv_heads).transpose(0, 1)  # [Hkv, 1, S, D]
    values = _head_major(v, kv_heads).transpose(0, 1)

    def part(a: int, b: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (kv_heads, group, b - a, head_dim)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            rows, keys[:, :, a:b].expand(shape), values[:, :, a:b].expand(shape), 0.0, causal
        )

    out, lse = part(p.past, end, True)
    if p.past or end < slots:
        out = out.float()
        if p.past:
            before, before_lse = part(0, p.past, False)
            total = torch.logaddexp(lse, before_lse)
            out = out * (lse - total).exp()[..., None] + before.float() * (before_lse - total).exp()[..., None]
            lse = total
        if end < slots:
            scores = torch.matmul(rows.float(), keys[:, :, end:].float().transpose(-1, -2)) * head_dim**-0.5
            weights = (scores + float("-inf") - lse[..., None]).exp()
            out = out + torch.matmul(weights, values[:, :, end:].float())
    return out.to(q.dtype).permute(2, 0, 1, 3).reshape(length, q_heads * head_dim)


def masked_chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, kv_heads: int
) -> torch.Tensor:
    """One prefill chunk with an explicit mask (chunk_bias) over all of its pages' slots: q [L, Hq,
    D], K and V [1, S * Hkv, D] -> [L, Hq * D]. Where the causal kernel does not run: on CUDA, with
    a window, and inside the compiled mixed-step layers.

    On the CPU the scores are two matmuls around a softmax in float32, every column computed: a
    fused kernel may skip blocks its mask covers, and Inductor's lowering of the fused call inside
    the compiled layers let a NaN past the chunk's end vanish (tests/model/test_runners.py)."""
    length, q_heads, head_dim = q.shape
    group = q_heads // kv_heads
    k, v = _head_major(k, kv_heads), _head_major(v, kv_heads)
    # A KV head's G query heads folded into the rows of one call: broadcasting K over G would
    # copy it G times.
    rows = q.view(length, kv_heads, group, head_dim).permute(1, 2, 0, 3)
    rows = rows.reshape(1, kv_heads, group * length, head_dim)
    if q.device.type == "cuda":
        attended = _sdpa(rows, k, v, bias)
    else:
        scores = torch.matmul(rows.float(), k.float().transpose(-1, -2)) * head_dim**-0.5 + bias.float()
        attended = torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
    return attended.view(kv_heads, group, length, head_dim).permute(2, 0, 1, 3).reshape(length, q_heads * head_dim)


def decode_bias(
    context: torch.Tensor, slots: int, q_heads: int, kv_heads: int, window: int | None
) -> torch.Tensor:
    """float32 [n, Hq, slots * Hkv]: 0 where query head h of sequence i may read column c, -inf
    elsewhere. Column c is slot c // Hkv of KV head c % Hkv, as pages are stored; query head h
    reads KV head h // G, so masking the other heads' columns leaves each head's softmax as if over
    its own slots. Slots at or past the context are masked, and with a window those before
    context - window (Mistral: a query sees the last `window` positions, itself included)."""
    column = torch.arange(slots * kv_heads, device=context.device)
    slot, head = column // kv_heads, column % kv_heads
    q_head = torch.arange(q_heads, device=context.device) // (q_heads // kv_heads)
    masked = (slot[None, None, :] >= context[:, None, None]) | (head[None, None, :] != q_head[None, :, None])
    if window is not None:
        masked = masked | (slot[None, None, :] < (context - window)[:, None, None])
    return torch.zeros(masked.shape, dtype=torch.float32, device=context.device).masked_fill(masked, float("-inf"))


def gather_kv(kv: torch.Tensor, layer: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer (long[1]) over page tables [n, W]: each [n, W * page_size * Hkv, D] in
    the storage dtype, token-major and heads fastest, as stored; every slot of every page read.

    The cache viewed as rows of one (page, layer, K or V) plane each: one index_select per plane
    copies whole pages (the 4-d view's per-element path was 5-20x slower on two threads, and
    advanced indexing slower still), and it is what the compiled layers gather with too."""
    pages, layers = kv.shape[0], kv.shape[1]
    rows = kv.view(pages * layers * 2, -1)
    first = (table * layers + layer) * 2
    n, head_dim = table.shape[0], kv.shape[-1]
    k = rows.index_select(0, first.reshape(-1)).view(n, -1, head_dim)
    v = rows.index_select(0, (first + 1).reshape(-1)).view(n, -1, head_dim)
    return k, v


def decode_attention(
    q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, table: torch.Tensor, bias: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """One new token per sequence: q [n, Hq, D] over its pages (table [n, W], bias from
    decode_bias) -> [n, Hq * D]. The decode attention of every runner: eager decode rows and the
    compiled layers run this code.

    Every query head is scored against every KV head's slots as gathered ([n, S * Hkv, D]) and the
    bias removes the other heads' columns: Hkv times the score arithmetic but no copy of K and V
    into head-major order, two batched matmuls over what was read. In float32: a NaN in K gives a
    NaN score (NaN + -inf), and weight 0 times a NaN in V is NaN, so a slot the clears missed
    reaches the output; nothing here skips a masked column."""
    n, q_heads, head_dim = q.shape
    k_raw, v_raw = gather_kv(kv, layer, table)
    k_scale, v_scale = scales[layer][0]
    k = from_storage(k_raw, k_scale, torch.float32)
    v = from_storage(v_raw, v_scale, torch.float32)
    scores = torch.baddbmm(bias, q.float(), k.transpose(1, 2), alpha=head_dim**-0.5)
    out = torch.bmm(torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype).view(n, q_heads * head_dim)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Fused attention with an additive mask, on a kernel that multiplies in every slot.

    On CUDA torch may pick among several kernels; only the memory-efficient and the math kernels
    are known to add the bias to every score rather than skip blocks it masks whole, which would
    hide a NaN the clearing rule failed to clear. The CPU kernel is held to it by
    tests/model/test_attention.py; the CUDA ones by scripts/device_check.sh.
    """
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
