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
from executor.host_copy import to_device
from executor.inputs import StepInputs
from executor.kernels import bmm_row_multiple


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
            index = to_device(seqs, device)
            rows = to_device(starts[seqs], device)
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


# The deterministic mode reads a row's slots in blocks of this many (whole pages): every product
# it computes has this many slots, whatever the context, the batch or the chunk.
BLOCK_SLOTS = 64


@dataclass
class InvariantItems:
    """Sequences whose rows attend in one pass: `items` of `per_item` new tokens each (the step's
    rows `rows`, item-major), over their page tables padded to whole blocks with the pad page."""

    rows: torch.Tensor  # long[items * per_item]
    items: int
    per_item: int
    padded_rows: int  # per_item * G, rounded up to the kernels' row multiple
    table: torch.Tensor  # long[items, blocks * block_pages]
    bias: torch.Tensor  # float32 [items, 1, padded_rows, slots]: 0 where a row may read a slot, else -inf


@dataclass
class InvariantAttention:
    """The deterministic mode's attention plan for one step and window: the step's one-token
    sequences as one set of items, each prefill chunk as one item (executor.model.attention's
    `invariant_attention` says why every row then gets the same bits in any batch)."""

    groups: list[InvariantItems]
    block_slots: int

    @classmethod
    def build(
        cls,
        inputs: StepInputs,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        page_size: int,
        pad_page: int,
        device: torch.device,
        *,
        window: int | None = None,
    ) -> InvariantAttention:
        block_pages = max(1, BLOCK_SLOTS // page_size)
        block_slots = block_pages * page_size
        group = q_heads // kv_heads
        multiple = max(bmm_row_multiple(head_dim, block_slots), bmm_row_multiple(block_slots, head_dim))
        query_lens = inputs.query_lens_host
        starts = np.concatenate(([0], np.cumsum(query_lens)[:-1]))
        pages = -(-inputs.context_lens_host // page_size)

        def items(seqs: np.ndarray, rows: torch.Tensor, per_item: int) -> InvariantItems:
            width = -(-int(pages[seqs].max()) // block_pages) * block_pages
            table = inputs.page_table[to_device(seqs, device)]
            table = F.pad(table[:, :width], (0, max(0, width - table.shape[1])), value=pad_page)
            padded = -(-per_item * group // multiple) * multiple
            positions = inputs.positions[rows].view(len(seqs), per_item)
            bias = invariant_bias(positions, width * page_size, window, group, padded)
            return InvariantItems(rows, len(seqs), per_item, padded, table, bias)

        groups = []
        decodes = np.flatnonzero(query_lens == 1)
        if decodes.size:
            groups.append(items(decodes, to_device(starts[decodes], device), 1))
        for seq in np.flatnonzero(query_lens > 1):
            start, length = int(starts[seq]), int(query_lens[seq])
            groups.append(items(np.array([seq]), torch.arange(start, start + length, device=device), length))
        return cls(groups, block_slots)


def invariant_bias(
    positions: torch.Tensor, slots: int, window: int | None, group: int, padded_rows: int
) -> torch.Tensor:
    """float32 [items, 1, padded_rows, slots] additive mask: row (token t, head g) at t * G + g reads
    the slots up to its token's position (and with a window only the last `window` of them); rows
    past per_item * G pad the product and read every slot (their output is dropped)."""
    slot = torch.arange(slots, device=positions.device)
    masked = slot[None, None, :] > positions[:, :, None]
    if window is not None:
        masked = masked | (slot[None, None, :] <= positions[:, :, None] - window)
    masked = masked.repeat_interleave(group, dim=1)
    masked = F.pad(masked, (0, 0, 0, padded_rows - masked.shape[1]), value=False)
    bias = torch.zeros(masked.shape, dtype=torch.float32, device=positions.device).masked_fill(masked, float("-inf"))
    return bias[:, None]


def invariant_attention(
    q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, scales: torch.Tensor, plan: InvariantAttention
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq * D]: every row's attention in the same order of operations whatever
    its batch mates, its chunk (a prefill row and the same token decoded are the same row), or the
    number of KV heads on its rank; float32 throughout.

    A row's slots are read in blocks of `block_slots` (whole pages): its scores are one fixed-shape
    product per block, K and V gathered whole; its softmax runs over all of its blocks at once, and
    torch's CPU softmax reduces a row lane by lane by slot index, so the blocks past a row's context
    (another sequence's longer table, the rest of a chunk) add exact zeros and change nothing; the
    weighted V sums are one fixed-shape product per block, added block after block by a cumulative
    sum, where those blocks add exact zeros too. The products' rows are padded to the multiple at
    which the BLAS kernel computes every row alike (executor.kernels.bmm_row_multiple).

    The clearing rule holds: every slot of every page read is multiplied in, and a masked NaN still
    reaches the row (NaN + -inf in a score is NaN; weight 0 times NaN in V is NaN)."""
    tokens, q_heads, head_dim = q.shape
    kv_heads = kv.shape[-2]
    group = q_heads // kv_heads
    k_scale, v_scale = scales[layer][0]
    out = torch.empty(tokens, q_heads * head_dim, dtype=q.dtype, device=q.device)
    b = plan.block_slots
    for g in plan.groups:
        n, m = g.items, g.padded_rows
        k_raw, v_raw = gather_kv(kv, layer, g.table)
        blocks = k_raw.shape[1] // (b * kv_heads)
        k = from_storage(k_raw, k_scale, torch.float32).view(n, blocks, b, kv_heads, head_dim)
        v = from_storage(v_raw, v_scale, torch.float32).view(n, blocks, b, kv_heads, head_dim)
        k_t = k.permute(0, 3, 1, 4, 2).reshape(-1, head_dim, b)  # [n * Hkv * blocks, D, b]
        v = v.permute(0, 3, 1, 2, 4).reshape(-1, b, head_dim)  # [n * Hkv * blocks, b, D]
        rows = q.index_select(0, g.rows).float().view(n, g.per_item, kv_heads, group, head_dim)
        rows = rows.permute(0, 2, 1, 3, 4).reshape(n, kv_heads, g.per_item * group, head_dim)
        rows = F.pad(rows, (0, 0, 0, m - rows.shape[2]))
        rows = rows[:, :, None].expand(n, kv_heads, blocks, m, head_dim).reshape(-1, m, head_dim)
        scores = torch.bmm(rows, k_t).mul_(head_dim**-0.5).view(n, kv_heads, blocks, m, b)
        scores = scores.transpose(2, 3).reshape(n, kv_heads, m, blocks * b) + g.bias
        weights = torch.softmax(scores, dim=-1).view(n, kv_heads, m, blocks, b).transpose(2, 3)
        parts = torch.bmm(weights.reshape(-1, m, b), v).view(n, kv_heads, blocks, m, head_dim)
        attended = parts.cumsum(dim=2)[:, :, -1, : g.per_item * group]
        attended = attended.reshape(n, kv_heads, g.per_item, group, head_dim).transpose(1, 2)
        out.index_copy_(0, g.rows, attended.reshape(n * g.per_item, q_heads * head_dim).to(q.dtype))
    return out
