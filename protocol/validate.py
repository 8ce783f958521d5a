"""Checks a receiver runs on a decoded frame before acting on it.

Every failure is a ProtocolError whose code says which rule was broken and whose message names the
offending field, index and value, so a REJECT is actionable on its own. Checks are vectorized: a
256-sequence PREPARE validates in tens of microseconds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from protocol.errors import ProtocolError, RejectCode
from protocol.frames import SUPPORTED_VERSIONS, CacheGeometry, Frame, Prepare

_UNSIGNED = {1: np.dtype(np.uint8), 4: np.dtype("<u4"), 8: np.dtype("<u8")}

_PER_SEQUENCE = (
    "query_lens",
    "context_lens",
    "page_table_lens",
    "page_table_base",
    "sample",
    "temperature",
    "top_p",
    "top_k",
    "seeds",
    "feedback",
)


def check_envelope(
    frame: Frame, *, version: int, layout: int, run_id: str, expected_step: int | None = None
) -> None:
    """The frame belongs to this launch, speaks the negotiated version and layout, and (when
    `expected_step` is given) carries that step number."""
    if frame.version != version:
        raise ProtocolError(
            RejectCode.BAD_VERSION,
            f"{frame.type.name} has protocol version {frame.version}; this peer negotiated {version}",
        )
    if frame.layout != layout:
        raise ProtocolError(
            RejectCode.BAD_LAYOUT,
            f"{frame.type.name} has cache layout version {frame.layout}; this peer negotiated {layout}",
        )
    if frame.run_id != run_id:
        raise ProtocolError(
            RejectCode.BAD_RUN_ID,
            f"{frame.type.name} belongs to run {frame.run_id!r}; this peer is in run {run_id!r}",
        )
    if expected_step is not None and frame.step != expected_step:
        raise ProtocolError(
            RejectCode.BAD_STEP,
            f"{frame.type.name} is for step {frame.step}; this peer expected step {expected_step}",
        )


def negotiate_version(offered: Iterable[int], supported: Iterable[int] = SUPPORTED_VERSIONS) -> int:
    """The highest protocol version both sides support."""
    offered_set = set(offered)
    supported_set = set(supported)
    common = offered_set & supported_set
    if not common:
        raise ProtocolError(
            RejectCode.BAD_VERSION,
            f"no common protocol version: the peer offers {sorted(offered_set)}, "
            f"this side supports {sorted(supported_set)}",
        )
    return max(common)


def check_geometry(expected: CacheGeometry, received: CacheGeometry, *, who: str) -> None:
    """Every rank must run the same cache geometry; name every field that differs."""
    if received == expected:
        return
    diffs = [
        f"{name} {getattr(received, name)!r} (expected {getattr(expected, name)!r})"
        for name in (f.name for f in dataclasses.fields(expected))
        if getattr(received, name) != getattr(expected, name)
    ]
    raise ProtocolError(
        RejectCode.GEOMETRY_MISMATCH, f"{who} has a different cache geometry: " + ", ".join(diffs)
    )


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _check_range(name: str, values: np.ndarray, high: int, code: RejectCode) -> None:
    """Every value in [0, high). Viewed as unsigned, a negative value is huge, so one max() covers
    both bounds: one reduction instead of two matters at a few microseconds each."""
    if values.size == 0:
        return
    if values.view(_UNSIGNED[values.dtype.itemsize]).max() >= high:
        i = _first_bad((values < 0) | (values >= high))
        raise ProtocolError(code, f"{name}[{i}] = {values[i]} is outside [0, {high})")


def _check_length(name: str, values: np.ndarray, expected: int, what: str) -> None:
    if len(values) != expected:
        raise ProtocolError(
            RejectCode.LENGTH_MISMATCH, f"{name} has {len(values)} entries; {what} is {expected}"
        )


def validate_prepare(p: Prepare, g: CacheGeometry) -> None:
    """Every rule of DESIGN.md for one step against the cache geometry (docs/protocol.md lists
    them). Each rule costs one or two numpy reductions; the precise message is worked out only
    once a rule has failed."""
    total_tokens = _check_shapes(p, g)
    if len(p.seq_ids):
        _check_sequences(p, g)
    _check_pages(p, g)
    _check_tokens(p, g, total_tokens)


def _check_shapes(p: Prepare, g: CacheGeometry) -> int:
    n = len(p.seq_ids)
    for name in _PER_SEQUENCE:
        _check_length(name, getattr(p, name), n, "the number of sequences (len(seq_ids))")
    _check_length("restore_slots", p.restore_slots, len(p.restore_pages), "len(restore_pages)")
    _check_length("offload_slots", p.offload_slots, len(p.offload_pages), "len(offload_pages)")
    if n > g.max_num_seqs:
        raise ProtocolError(RejectCode.LIMIT_EXCEEDED, f"{n} sequences exceed max_num_seqs {g.max_num_seqs}")
    if n == 0:
        _check_length("token_ids", p.token_ids, 0, "sum(query_lens)")
        _check_length("positions", p.positions, 0, "sum(query_lens)")
        _check_length("page_table", p.page_table, 0, "sum(page_table_lens)")
        return 0
    query_lens = p.query_lens
    if query_lens.min() < 1:
        i = _first_bad(query_lens < 1)
        raise ProtocolError(
            RejectCode.BAD_QUERY_LEN,
            f"query_lens[{i}] = {query_lens[i]}; every sequence needs >= 1 new token",
        )
    # int32 sums accumulate in int64: no overflow.
    total_tokens = int(query_lens.sum())
    _check_length("token_ids", p.token_ids, total_tokens, "sum(query_lens)")
    _check_length("positions", p.positions, total_tokens, "sum(query_lens)")
    if total_tokens > g.max_num_batched_tokens:
        raise ProtocolError(
            RejectCode.LIMIT_EXCEEDED,
            f"{total_tokens} new tokens exceed max_num_batched_tokens {g.max_num_batched_tokens}",
        )
    page_table_lens = p.page_table_lens
    if page_table_lens.view(np.uint32).max() > g.max_pages_per_seq:
        i = _first_bad((page_table_lens < 0) | (page_table_lens > g.max_pages_per_seq))
        code = RejectCode.LENGTH_MISMATCH if page_table_lens[i] < 0 else RejectCode.LIMIT_EXCEEDED
        raise ProtocolError(
            code,
            f"page_table_lens[{i}] = {page_table_lens[i]} is outside [0, {g.max_pages_per_seq}] "
            f"(max_model_len {g.max_model_len} / page_size {g.page_size})",
        )
    base = p.page_table_base
    # Tested first, base >= 0 keeps the subtraction from overflowing.
    if base.min() < 0 or (page_table_lens - base).min() < 0:
        i = _first_bad((base < 0) | (base > page_table_lens))
        raise ProtocolError(
            RejectCode.LENGTH_MISMATCH,
            f"page_table_base[{i}] = {base[i]} is outside [0, page_table_lens[{i}] = {page_table_lens[i]}]",
        )
    _check_length(
        "page_table", p.page_table, int(page_table_lens.sum() - base.sum()), "sum(page_table_lens - page_table_base)"
    )
    return total_tokens


def _check_sequences(p: Prepare, g: CacheGeometry) -> None:
    query_lens, context_lens, page_table_lens = p.query_lens, p.context_lens, p.page_table_lens
    # query_lens >= 1 and page_table_lens <= max_pages_per_seq hold here, so none of this overflows.
    if (context_lens - query_lens).min() < 0 or context_lens.max() > g.max_model_len:
        i = _first_bad((context_lens < query_lens) | (context_lens > g.max_model_len))
        raise ProtocolError(
            RejectCode.BAD_CONTEXT_LEN,
            f"context_lens[{i}] = {context_lens[i]} must be in [query_lens[{i}] = {query_lens[i]}, "
            f"max_model_len {g.max_model_len}]",
        )
    if (page_table_lens * g.page_size - context_lens).min() < 0:
        i = _first_bad(page_table_lens * g.page_size < context_lens)
        raise ProtocolError(
            RejectCode.PAGE_TABLE_TOO_SHORT,
            f"sequence {i} has {page_table_lens[i]} pages of {g.page_size} slots for a context of "
            f"{context_lens[i]} tokens",
        )
    if len(p.seq_ids) > 1:
        ids = np.sort(p.seq_ids)
        repeated = ids[1:] == ids[:-1]
        if repeated.any():
            raise ProtocolError(
                RejectCode.DUPLICATE_SEQ_ID,
                f"seq_id {ids[_first_bad(repeated)]} appears more than once in one step",
            )
    # NaN fails every comparison, so min() >= 0 also rejects NaN.
    temperature, top_p = p.temperature, p.top_p
    if not (temperature.min() >= 0 and temperature.max() < np.inf):
        raise ProtocolError(RejectCode.BAD_SAMPLING, "temperature must be finite and >= 0 for every sequence")
    if not (top_p.min() > 0 and top_p.max() <= 1):
        raise ProtocolError(RejectCode.BAD_SAMPLING, "top_p must be in (0, 1] for every sequence")
    if p.top_k.min() < 0:
        raise ProtocolError(RejectCode.BAD_SAMPLING, "top_k must be >= 0 (0 means off) for every sequence")
    feedback = p.feedback
    if feedback.max() > 1 or (feedback.astype(bool) & (query_lens != 1)).any():
        i = _first_bad((feedback > 1) | (feedback.astype(bool) & (query_lens != 1)))
        raise ProtocolError(
            RejectCode.BAD_FEEDBACK,
            f"feedback[{i}] = {feedback[i]} with query_lens[{i}] = {query_lens[i]}: feedback is 0 or 1, "
            "and 1 only for a sequence with one new token",
        )


def _check_pages(p: Prepare, g: CacheGeometry) -> None:
    for name in ("page_table", "cleared_pages", "restore_pages", "offload_pages", "poison_pages"):
        _check_range(name, getattr(p, name), g.num_kv_pages, RejectCode.PAGE_OUT_OF_RANGE)
    _check_range("restore_slots", p.restore_slots, g.num_host_pages, RejectCode.SLOT_OUT_OF_RANGE)
    _check_range("offload_slots", p.offload_slots, g.num_host_pages, RejectCode.SLOT_OUT_OF_RANGE)

    cleared = p.cleared_pages
    if cleared.size > 1:
        unsorted = cleared[1:] <= cleared[:-1]
        if unsorted.any():
            i = _first_bad(unsorted) + 1
            raise ProtocolError(
                RejectCode.CLEARED_NOT_SORTED_UNIQUE,
                f"cleared_pages must be strictly increasing: cleared_pages[{i}] = {cleared[i]} follows "
                f"{cleared[i - 1]}",
            )
    if cleared.size and p.restore_pages.size:
        at = np.minimum(np.searchsorted(cleared, p.restore_pages), cleared.size - 1)
        both = cleared[at] == p.restore_pages
        if both.any():
            page = p.restore_pages[_first_bad(both)]
            raise ProtocolError(
                RejectCode.CLEARED_RESTORE_OVERLAP,
                f"page {page} is both cleared and a restore target; a restore overwrites it whole",
            )


def _check_tokens(p: Prepare, g: CacheGeometry, total_tokens: int) -> None:
    _check_range("token_ids", p.token_ids, g.vocab_size, RejectCode.TOKEN_OUT_OF_RANGE)
    if total_tokens == 0:
        return
    # Token j of sequence i sits at position context_lens[i] - query_lens[i] + j: anything else would
    # write KV outside the slots its page table covers. With context_lens <= max_model_len checked,
    # this also keeps every position in [0, max_model_len).
    if total_tokens == len(p.seq_ids):
        expected = p.context_lens - 1
    else:
        query_lens = p.query_lens
        starts = np.cumsum(query_lens) - query_lens
        expected = np.repeat(p.context_lens - query_lens - starts, query_lens) + np.arange(total_tokens)
    wrong = p.positions != expected
    if wrong.any():
        _check_range("positions", p.positions, g.max_model_len, RejectCode.POSITION_OUT_OF_RANGE)
        t = _first_bad(wrong)
        raise ProtocolError(
            RejectCode.POSITION_MISMATCH,
            f"positions[{t}] = {p.positions[t]}, expected {expected[t]} "
            f"(context_lens - query_lens + offset within the sequence)",
        )
