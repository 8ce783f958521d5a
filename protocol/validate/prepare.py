"""PREPARE's rules against the cache geometry: lengths and limits, sequences, page ids, positions,
then (on an otherwise sound frame) the sequences' own fields. Arithmetic on wire values is done in
int64 after the operands are range-checked (or compares instead of subtracting), so no int32 wraps.
Anything broken here but the own fields refuses the whole frame."""

from __future__ import annotations

import numpy as np

from protocol.errors import ProtocolError, RejectCode
from protocol.frames import PREPARE_FIELDS, CacheGeometry, Extent, Prepare, max_decode_steps
from protocol.grammar import GRAMMAR_MAX_BYTES
from protocol.sampling_limits import LOGIT_BIAS_MAX_ENTRIES
from protocol.validate.array_checks import check_length, check_range, first_bad
from protocol.validate.own_fields import check_own_fields

# Derived from PREPARE's declarations (protocol.frames.PREPARE_FIELDS): a field added there is
# length-checked here without a line of its own.
_PER_SEQUENCE = tuple(f.name for f in PREPARE_FIELDS if f.extent is Extent.SEQUENCE and f.name != "seq_ids")
_PER_TOKEN = tuple(f.name for f in PREPARE_FIELDS if f.extent is Extent.TOKEN)
_PAIRED = tuple((f.name, f.counts) for f in PREPARE_FIELDS if f.extent is Extent.LIST and f.counts)
# The most entries one sequence may have in a flat array, by its count field: a number, or the
# geometry's max_model_len / vocab_size (a history holds at most the context, a banned list at most
# every token).
_MOST = {
    "history_lens": "max_model_len",
    "logit_bias_lens": LOGIT_BIAS_MAX_ENTRIES,
    "banned_lens": "vocab_size",
    "grammar_lens": GRAMMAR_MAX_BYTES,
}
# Per-sequence counts of PREPARE's flat arrays: (counts, the flat arrays it counts, the most).
_FLAT = tuple(
    (counts, tuple(f.name for f in PREPARE_FIELDS if f.counts == counts and f.extent is Extent.COUNTED), _MOST[counts])
    for counts in dict.fromkeys(f.counts for f in PREPARE_FIELDS if f.extent is Extent.COUNTED)
)


def validate_prepare(p: Prepare, g: CacheGeometry) -> None:
    """Every rule of DESIGN.md for one step against the cache geometry (docs/protocol.md lists
    them), for a Prepare with the wire's dtypes (as decoded). Each rule costs one or two numpy
    reductions; the precise message is worked out only once a rule has failed."""
    total_tokens = _check_shapes(p, g)
    _check_decode_steps(p, g)
    if len(p.seq_ids):
        _check_sequences(p, g)
    _check_pages(p, g)
    if total_tokens:
        _check_positions(p, g, total_tokens)
        check_own_fields(p, g)


def validate_continued(p: Prepare, g: CacheGeometry) -> None:
    """validate_prepare for `p` = protocol.continuation.expand(held, c), where `held` passed it:
    only the rules that what a CONTINUE changes can break. The new context (held + 1) against
    max_model_len and its page table, the tables' lengths with the pages appended, every page id
    and the clears' order; lengths, positions, sequence ids and the sequences' own fields are
    held's or constants by construction. A test holds the two to the same verdict."""
    _check_decode_steps(p, g)
    if len(p.seq_ids):
        _check_table_lens(p, g)
        _check_sequences(p, g)
    _check_pages(p, g)


def _check_shapes(p: Prepare, g: CacheGeometry) -> int:
    n = len(p.seq_ids)
    for name in _PER_SEQUENCE:
        check_length(name, getattr(p, name), n, "the number of sequences (len(seq_ids))")
    for name, paired in _PAIRED:
        check_length(name, getattr(p, name), len(getattr(p, paired)), f"len({paired})")
    _check_flat_lengths(p, g)
    if n > g.max_num_seqs:
        raise ProtocolError(RejectCode.LIMIT_EXCEEDED, f"{n} sequences exceed max_num_seqs {g.max_num_seqs}")
    if n == 0:
        for name in _PER_TOKEN:
            check_length(name, getattr(p, name), 0, "sum(query_lens)")
        check_length("page_table", p.page_table, 0, "sum(page_table_lens)")
        return 0
    query_lens = p.query_lens
    if query_lens.min() < 1:
        i = first_bad(query_lens < 1)
        raise ProtocolError(
            RejectCode.BAD_QUERY_LEN,
            f"query_lens[{i}] = {query_lens[i]}; every sequence needs >= 1 new token",
        )
    total_tokens = int(query_lens.sum(dtype=np.int64))
    for name in _PER_TOKEN:
        check_length(name, getattr(p, name), total_tokens, "sum(query_lens)")
    if total_tokens > g.max_num_batched_tokens:
        raise ProtocolError(
            RejectCode.LIMIT_EXCEEDED,
            f"{total_tokens} new tokens exceed max_num_batched_tokens {g.max_num_batched_tokens}",
        )
    _check_table_lens(p, g)
    page_table_lens, base = p.page_table_lens, p.page_table_base
    delta_pages = int(page_table_lens.sum(dtype=np.int64) - base.sum(dtype=np.int64))
    check_length("page_table", p.page_table, delta_pages, "sum(page_table_lens - page_table_base)")
    return total_tokens


def _check_table_lens(p: Prepare, g: CacheGeometry) -> None:
    """Each page table within max_pages_per_seq, and its base within it."""
    page_table_lens = p.page_table_lens
    if page_table_lens.view(np.uint32).max() > g.max_pages_per_seq:
        i = first_bad((page_table_lens < 0) | (page_table_lens > g.max_pages_per_seq))
        code = RejectCode.LENGTH_MISMATCH if page_table_lens[i] < 0 else RejectCode.LIMIT_EXCEEDED
        raise ProtocolError(
            code,
            f"page_table_lens[{i}] = {page_table_lens[i]} is outside [0, {g.max_pages_per_seq}] "
            f"(max_model_len {g.max_model_len} / page_size {g.page_size})",
        )
    base = p.page_table_base
    if base.min() < 0 or (base > page_table_lens).any():
        i = first_bad((base < 0) | (base > page_table_lens))
        raise ProtocolError(
            RejectCode.LENGTH_MISMATCH,
            f"page_table_base[{i}] = {base[i]} is outside [0, page_table_lens[{i}] = {page_table_lens[i]}]",
        )


def _check_flat_lengths(p: Prepare, g: CacheGeometry) -> None:
    """Each flat logits-processing array holds what its per-sequence counts say (checked >= 0 and
    under their limits first, so that the int64 sums are exact)."""
    for counts_name, flat_names, most in _FLAT:
        counts = getattr(p, counts_name)
        if not counts.shape[0]:
            limit = 0
        else:
            if counts.min() < 0:
                i = first_bad(counts < 0)
                raise ProtocolError(RejectCode.LENGTH_MISMATCH, f"{counts_name}[{i}] = {counts[i]} is negative")
            limit = getattr(g, most) if isinstance(most, str) else most
            if counts.max() > limit:
                i = first_bad(counts > limit)
                raise ProtocolError(
                    RejectCode.LIMIT_EXCEEDED, f"{counts_name}[{i}] = {counts[i]} exceeds the limit of {limit}"
                )
        total = int(counts.sum(dtype=np.int64))
        for name in flat_names:
            check_length(name, getattr(p, name), total, f"sum({counts_name})")
    prompt = p.history_prompt_lens
    if prompt.shape[0] and ((prompt < 0) | (prompt > p.history_lens)).any():
        i = first_bad((prompt < 0) | (prompt > p.history_lens))
        raise ProtocolError(
            RejectCode.LENGTH_MISMATCH,
            f"history_prompt_lens[{i}] = {prompt[i]} is outside [0, history_lens[{i}] = {p.history_lens[i]}]",
        )


def _check_decode_steps(p: Prepare, g: CacheGeometry) -> None:
    """Several forwards on one frame only for a plain decode step (each sequence one new token,
    sampled, nothing banned: what its forwards after the first feed themselves), within one page
    boundary per table (so a CONTINUE after it still grows each table by one page at most)."""
    steps = p.decode_steps
    most = max_decode_steps(g.page_size)
    if not 1 <= steps <= most:
        raise ProtocolError(RejectCode.BAD_DECODE_STEPS, f"decode_steps = {steps} is outside [1, {most}]")
    if steps == 1:
        return
    n = len(p.seq_ids)
    if not n or p.token_ids.shape[0] != n or not p.sample.all() or p.banned_lens.any():
        raise ProtocolError(
            RejectCode.BAD_DECODE_STEPS,
            f"decode_steps = {steps} in a step that is not a plain decode (one new token per sequence, every "
            "sequence sampled, no token banned)",
        )


def _check_sequences(p: Prepare, g: CacheGeometry) -> None:
    query_lens, context_lens = p.query_lens, p.context_lens
    final = p.final_context_lens
    if (context_lens < query_lens).any() or final.max() > g.max_model_len:
        i = first_bad((context_lens < query_lens) | (final > g.max_model_len))
        raise ProtocolError(
            RejectCode.BAD_CONTEXT_LEN,
            f"context_lens[{i}] = {context_lens[i]} must be in [query_lens[{i}] = {query_lens[i]}, "
            f"max_model_len {g.max_model_len}]" + (f" after {p.decode_steps} forwards" if p.decode_steps > 1 else ""),
        )
    # page_table_lens <= max_pages_per_seq holds, so the int64 product is exact.
    slots = p.page_table_lens.astype(np.int64) * g.page_size
    if (slots < final).any():
        i = first_bad(slots < final)
        raise ProtocolError(
            RejectCode.PAGE_TABLE_TOO_SHORT,
            f"sequence {i} has {p.page_table_lens[i]} pages of {g.page_size} slots for a context of "
            f"{final[i]} tokens",
        )
    if len(p.seq_ids) > 1:
        ids = np.sort(p.seq_ids)
        repeated = ids[1:] == ids[:-1]
        if repeated.any():
            raise ProtocolError(
                RejectCode.DUPLICATE_SEQ_ID,
                f"seq_id {ids[first_bad(repeated)]} appears more than once in one step",
            )


def _check_pages(p: Prepare, g: CacheGeometry) -> None:
    for name in ("page_table", "cleared_pages", "restore_pages", "offload_pages", "poison_pages"):
        check_range(name, getattr(p, name), g.num_kv_pages, RejectCode.PAGE_OUT_OF_RANGE)
    check_range("restore_slots", p.restore_slots, g.num_host_pages, RejectCode.SLOT_OUT_OF_RANGE)
    check_range("offload_slots", p.offload_slots, g.num_host_pages, RejectCode.SLOT_OUT_OF_RANGE)

    cleared = p.cleared_pages
    if cleared.size > 1:
        unsorted = cleared[1:] <= cleared[:-1]
        if unsorted.any():
            i = first_bad(unsorted) + 1
            raise ProtocolError(
                RejectCode.CLEARED_NOT_SORTED_UNIQUE,
                f"cleared_pages must be strictly increasing: cleared_pages[{i}] = {cleared[i]} follows "
                f"{cleared[i - 1]}",
            )
    if cleared.size and p.restore_pages.size:
        at = np.minimum(cleared.searchsorted(p.restore_pages), cleared.size - 1)
        both = cleared[at] == p.restore_pages
        if both.any():
            page = p.restore_pages[first_bad(both)]
            raise ProtocolError(
                RejectCode.CLEARED_RESTORE_OVERLAP,
                f"page {page} is both cleared and a restore target; a restore overwrites it whole",
            )


def _check_positions(p: Prepare, g: CacheGeometry, total_tokens: int) -> None:
    # Token j of sequence i sits at position context_lens[i] - query_lens[i] + j: anything else would
    # write KV outside the slots its page table covers. With query_lens <= context_lens <=
    # max_model_len checked, this also keeps every position in [0, max_model_len).
    context_lens = p.context_lens.astype(np.int64)
    if total_tokens == len(p.seq_ids):
        expected = context_lens - 1
    else:
        query_lens = p.query_lens.astype(np.int64)
        starts = query_lens.cumsum() - query_lens
        expected = (context_lens - query_lens - starts).repeat(query_lens) + np.arange(total_tokens)
    wrong = p.positions != expected
    if wrong.any():
        check_range("positions", p.positions, g.max_model_len, RejectCode.POSITION_OUT_OF_RANGE)
        t = first_bad(wrong)
        raise ProtocolError(
            RejectCode.POSITION_MISMATCH,
            f"positions[{t}] = {p.positions[t]}, expected {expected[t]} "
            f"(context_lens - query_lens + offset within the sequence)",
        )


