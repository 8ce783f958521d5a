"""Checks a receiver runs on a decoded frame before acting on it.

Every failure is a ProtocolError whose code says which rule was broken and whose message names the
offending field, index and value, so a REJECT is actionable on its own; nothing else escapes, whatever
a correctly signed frame holds. Arithmetic on wire values is done in int64 after the operands are
range-checked (or compares instead of subtracting), so no int32 wraps. Checks are vectorized: a
256-sequence PREPARE validates in tens of microseconds.

Rules broken by a sequence's own fields (sampling parameters, feedback, token ids) are checked last,
on an otherwise sound frame, and name every offending sequence in ProtocolError.seq_ids, so that only
their requests fail. Everything else (lengths, limits, page ids, ordering) refuses the whole frame.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from protocol.errors import ProtocolError, RejectCode
from protocol.frames import SUPPORTED_VERSIONS, CacheGeometry, Frame, Prepare
from protocol.sampling_limits import FLOAT32_MAX, TEMPERATURE_MIN, TOP_P_MIN

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
    them), for a Prepare with the wire's dtypes (as decoded). Each rule costs one or two numpy
    reductions; the precise message is worked out only once a rule has failed."""
    total_tokens = _check_shapes(p, g)
    if len(p.seq_ids):
        _check_sequences(p, g)
    _check_pages(p, g)
    if total_tokens:
        _check_positions(p, g, total_tokens)
        _check_own_fields(p, g)


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
    total_tokens = int(query_lens.sum(dtype=np.int64))
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
    if base.min() < 0 or (base > page_table_lens).any():
        i = _first_bad((base < 0) | (base > page_table_lens))
        raise ProtocolError(
            RejectCode.LENGTH_MISMATCH,
            f"page_table_base[{i}] = {base[i]} is outside [0, page_table_lens[{i}] = {page_table_lens[i]}]",
        )
    delta_pages = int(page_table_lens.sum(dtype=np.int64) - base.sum(dtype=np.int64))
    _check_length("page_table", p.page_table, delta_pages, "sum(page_table_lens - page_table_base)")
    return total_tokens


def _check_sequences(p: Prepare, g: CacheGeometry) -> None:
    query_lens, context_lens = p.query_lens, p.context_lens
    if (context_lens < query_lens).any() or context_lens.max() > g.max_model_len:
        i = _first_bad((context_lens < query_lens) | (context_lens > g.max_model_len))
        raise ProtocolError(
            RejectCode.BAD_CONTEXT_LEN,
            f"context_lens[{i}] = {context_lens[i]} must be in [query_lens[{i}] = {query_lens[i]}, "
            f"max_model_len {g.max_model_len}]",
        )
    # page_table_lens <= max_pages_per_seq holds, so the int64 product is exact.
    slots = p.page_table_lens.astype(np.int64) * g.page_size
    if (slots < context_lens).any():
        i = _first_bad(slots < context_lens)
        raise ProtocolError(
            RejectCode.PAGE_TABLE_TOO_SHORT,
            f"sequence {i} has {p.page_table_lens[i]} pages of {g.page_size} slots for a context of "
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


def _check_positions(p: Prepare, g: CacheGeometry, total_tokens: int) -> None:
    # Token j of sequence i sits at position context_lens[i] - query_lens[i] + j: anything else would
    # write KV outside the slots its page table covers. With query_lens <= context_lens <=
    # max_model_len checked, this also keeps every position in [0, max_model_len).
    context_lens = p.context_lens.astype(np.int64)
    if total_tokens == len(p.seq_ids):
        expected = context_lens - 1
    else:
        query_lens = p.query_lens.astype(np.int64)
        starts = np.cumsum(query_lens) - query_lens
        expected = np.repeat(context_lens - query_lens - starts, query_lens) + np.arange(total_tokens)
    wrong = p.positions != expected
    if wrong.any():
        _check_range("positions", p.positions, g.max_model_len, RejectCode.POSITION_OUT_OF_RANGE)
        t = _first_bad(wrong)
        raise ProtocolError(
            RejectCode.POSITION_MISMATCH,
            f"positions[{t}] = {p.positions[t]}, expected {expected[t]} "
            f"(context_lens - query_lens + offset within the sequence)",
        )


def _check_own_fields(p: Prepare, g: CacheGeometry) -> None:
    """The rules one sequence's own fields can break; the error names every sequence that broke
    any of them. NaN fails every comparison, so each rule is written as "not (the valid range)"."""
    temperature, top_p, feedback = p.temperature, p.top_p, p.feedback
    rules = [
        (
            RejectCode.BAD_SAMPLING,
            "temperature",
            f"0 (greedy) or in [{TEMPERATURE_MIN}, {FLOAT32_MAX:.7g}]",
            ~((temperature == 0) | ((temperature >= TEMPERATURE_MIN) & (temperature <= FLOAT32_MAX))),
        ),
        (RejectCode.BAD_SAMPLING, "top_p", f"in [{TOP_P_MIN}, 1]", ~((top_p >= TOP_P_MIN) & (top_p <= 1))),
        (RejectCode.BAD_SAMPLING, "top_k", ">= 0 (0: off)", p.top_k < 0),
        (RejectCode.BAD_SAMPLING, "seeds", "-1 (unseeded) or in [0, 2**63)", p.seeds < -1),
        (
            RejectCode.BAD_FEEDBACK,
            "feedback",
            "0, or 1 on a sequence with one new token",
            (feedback > 1) | ((feedback != 0) & (p.query_lens != 1)),
        ),
    ]
    tokens = p.token_ids
    if tokens.view(np.uint32).max() >= g.vocab_size:
        bad_token = (tokens < 0) | (tokens >= g.vocab_size)
        owner = np.repeat(np.arange(len(p.seq_ids)), p.query_lens)
        rules.append((
            RejectCode.TOKEN_OUT_OF_RANGE,
            "token_ids",
            f"every new token in [0, {g.vocab_size})",
            np.bincount(owner[bad_token], minlength=len(p.seq_ids)) > 0,
        ))
    broken = [(code, name, valid, mask) for code, name, valid, mask in rules if mask.any()]
    if not broken:
        return
    offenders = np.logical_or.reduce([mask for *_, mask in broken])
    reasons = []
    for _, name, valid, mask in broken:
        rows = np.flatnonzero(mask)
        shown = ", ".join(_describe(p, g, name, int(i)) for i in rows[:3])
        more = f" and {len(rows) - 3} more" if len(rows) > 3 else ""
        reasons.append(f"{name} must be {valid}: {shown}{more}")
    raise ProtocolError(broken[0][0], "; ".join(reasons), seq_ids=tuple(p.seq_ids[offenders].tolist()))


def _describe(p: Prepare, g: CacheGeometry, name: str, i: int) -> str:
    who = f"sequence {int(p.seq_ids[i])} (index {i})"
    if name != "token_ids":
        return f"{who} has {getattr(p, name)[i]!r}"
    start = int(p.query_lens[:i].sum(dtype=np.int64))
    own = p.token_ids[start : start + int(p.query_lens[i])]
    return f"{who} has {int(own[(own < 0) | (own >= g.vocab_size)][0])}"
