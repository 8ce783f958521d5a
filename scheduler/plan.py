"""A step plan and the assembly of its PREPARE from the batch.

Planning collects, in a StepBuilder, what a step does besides feeding its rows (pages to clear,
offloads, restores) and which rows are not plain decodes (prefill chunks, admissions); `assemble`
turns that and the batch's columns into the PREPARE, and advances the rows as planned: computed
tokens grow at plan time, the tokens a step samples are counted as pending until its RESULT. A step
that is the step before's rows, one token on, is said as a CONTINUE, and its PREPARE is the one
protocol.continuation expands that to, as every rank does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocol.continuation import expand
from protocol.frames import PREPARE_FIELD, Continue, Extent, Prepare
from protocol.page_tables import delta_index
from scheduler.batch import Batch, frozen
from scheduler.request import HostCopy

_I32 = np.int32
EMPTY_I32 = frozen(np.empty(0, dtype=_I32))
EMPTY_F32 = frozen(np.empty(0, dtype=np.float32))
EMPTY_U8 = frozen(np.empty(0, dtype=np.uint8))
# The logits-processing fields _processed fills for rows that need them; rows that do not take
# their declared defaults (0: no state, nothing sent, nothing banned).
PROCESSED = tuple(PREPARE_FIELD[name] for name in (
    "sampling_state", "history_lens", "history_prompt_lens", "history", "logit_bias_lens", "logit_bias_ids",
    "logit_bias", "banned_lens", "banned_ids", "grammar_lens", "grammar",
))


def _unprocessed(zeros_i32: np.ndarray, zeros_u8: np.ndarray) -> dict:
    """PROCESSED for rows that need none of it, from arrays of zeros the caller may share between
    steps (a decode step's come from the batch's snapshot)."""
    zeros = {np.dtype(np.uint8): zeros_u8, np.dtype(_I32): zeros_i32}
    return {
        f.name: zeros[f.dtype] if f.extent is Extent.SEQUENCE else np.empty(0, dtype=f.dtype) for f in PROCESSED
    }


@dataclass(frozen=True)
class StepPlan:
    """One planned step: its number, its PREPARE, and what the scheduler needs when it ends."""

    step: int
    prepare: Prepare
    rows: np.ndarray  # int32[n]: batch row of each PREPARE sequence, valid while moves is Batch.moves
    moves: int
    restore_slots: tuple[int, ...]  # host slots this step reads; free again once it has ended
    restored: tuple[tuple[int, HostCopy], ...]  # requests this step restores, and from where
    offloaded: tuple[int, ...]  # request ids whose KV this step copies out to host slots
    brief: Continue | None = None  # what the ranks are sent instead of `prepare`, if they hold the step before's
    # With several forwards: the one at which the first row to end samples its last token (the
    # frame's decode_steps or more when none ends inside it), where a seat frees.
    first_row_end: int = 1


class StepBuilder:
    """What a plan collects before it becomes a PREPARE (a plain slots class: one per step)."""

    __slots__ = (
        "cleared", "offload_pages", "offload_slots", "offloaded", "restore_pages", "restore_slots", "restored",
        "preempted", "rows", "chunks",
    )

    def __init__(self) -> None:
        self.cleared: list[np.ndarray] = []
        self.offload_pages: list[np.ndarray] = []
        self.offload_slots: list[int] = []
        self.offloaded: list[int] = []
        self.restore_pages: list[np.ndarray] = []
        self.restore_slots: list[int] = []
        self.restored: list[tuple[int, HostCopy]] = []
        self.preempted = 0
        self.rows: list[int] = []  # rows that are not plain decodes, in order
        self.chunks: list[int] = []


def cat(arrays: list[np.ndarray]) -> np.ndarray:
    if not arrays:
        return EMPTY_I32
    if len(arrays) == 1:
        return arrays[0].astype(_I32, copy=False)
    return np.concatenate(arrays).astype(_I32, copy=False)


def _new_pages(batch: Batch, rows: np.ndarray, base: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The pages of each row's table from base to lens, concatenated: the PREPARE's page_table."""
    grown = lens - base
    at = grown.nonzero()[0]
    if at.shape[0] == int(grown.sum()):  # a decode step: each table grew by one page at most
        return batch.pages[rows[at], base[at]]
    at, cols = delta_index(base, lens)
    return batch.pages[rows[at], cols]


# PREPARE's per-sequence fields that are a batch column of the row as it is (field -> column). The
# others are computed by _arrays; protocol.frames.PREPARE_FIELDS declares them all, and a test holds
# this map and _arrays to covering every one.
ROW_COLUMNS = {
    "seq_ids": "req_id",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seeds": "seed",
    "num_logprobs": "nlogprobs",
    "presence_penalty": "presence",
    "frequency_penalty": "frequency",
    "repetition_penalty": "repetition",
    "min_p": "min_p",
}


def _processed(batch: Batch, rows: np.ndarray, base: np.ndarray, sample: np.ndarray) -> dict:
    """The processing fields of a step's rows (base: the page-table pages the executors hold, from
    before the step). A sampling state travels whole exactly when the page table does: both are
    forgotten together (a new row, one absent from the last step, any row after an ABORT). It holds
    the tokens the request knows; a feedback row's token is added by the executors. Stop tokens are
    banned from a sample that would come before min_tokens."""
    n = rows.shape[0]
    state = np.where(batch.stateful[rows], np.where(base == 0, 1, 2), 0).astype(np.uint8)
    history_lens, prompt_lens = np.zeros(n, dtype=_I32), np.zeros(n, dtype=_I32)
    bias_lens, banned_lens = np.zeros(n, dtype=_I32), np.zeros(n, dtype=_I32)
    grammar_lens = np.zeros(n, dtype=_I32)
    history, bias_ids, bias, banned, grammars = [], [], [], [], []
    reqs = batch.reqs
    for i in (state == 1).nonzero()[0].tolist():
        r = int(rows[i])
        req = reqs[r]
        params = req.params
        if params.penalized or params.grammar is not None:
            # The prompt travels only for the repetition penalty; presence and frequency count the
            # output, and a grammar's state is rebuilt from it.
            start = 0 if params.repetition_penalty != 1 else req.prompt_len
            known = int(batch.ntok[r])
            history.append(req.tokens[start:known])
            history_lens[i] = known - start
            prompt_lens[i] = req.prompt_len - start
        if params.grammar is not None:
            grammars.append(params.grammar_bytes)
            grammar_lens[i] = len(params.grammar_bytes)
        if params.logit_bias:
            ids, values = req.bias_arrays
            bias_ids.append(ids)
            bias.append(values)
            bias_lens[i] = ids.shape[0]
    min_len = batch.min_len[rows]
    early = (sample != 0) & (batch.ntok[rows] + batch.pending[rows] < min_len)
    for i in early.nonzero()[0].tolist():
        stops = reqs[int(rows[i])].stop_array
        banned.append(stops)
        banned_lens[i] = stops.shape[0]
    return dict(
        sampling_state=state, history_lens=history_lens, history_prompt_lens=prompt_lens, history=cat(history),
        logit_bias_lens=bias_lens, logit_bias_ids=cat(bias_ids),
        logit_bias=np.concatenate(bias).astype(np.float32, copy=False) if bias else EMPTY_F32,
        banned_lens=banned_lens, banned_ids=cat(banned), grammar_lens=grammar_lens,
        grammar=np.frombuffer(b"".join(grammars), dtype=np.uint8) if grammars else EMPTY_U8,
    )


def _arrays(batch: Batch, dec_rows: np.ndarray | None, b: StepBuilder, fed: bool) -> dict:
    """The PREPARE arrays of a step: every row of the batch decoding (dec_rows None), or the decodes
    dec_rows then the chunks b.rows; fed: rows may feed back a sample of a step in flight. One path
    for both: a step where every row decodes takes the batch's snapshot of its constant columns and
    its ready-made ones and zeros (shared by every such PREPARE until rows change) instead of
    indexing them again."""
    n = batch.n
    everyone = dec_rows is None
    if everyone:
        snap = batch.snapshot()
        rows, n_dec, qlens, columns = snap.rows, n, snap.ones, snap.columns
        start = batch.ncomp[:n].copy()
        positions = start
        chunk_tokens = []
    else:
        n_dec = dec_rows.shape[0]
        rows = np.concatenate((dec_rows.astype(_I32), np.array(b.rows, dtype=_I32)))
        qlens = np.concatenate((np.ones(n_dec, dtype=_I32), np.array(b.chunks, dtype=_I32)))
        columns = {column: getattr(batch, column)[rows] for column in ROW_COLUMNS.values()}
        start = batch.ncomp[rows]
        # Each row's positions run from its start: one arange for the step, shifted per row.
        ends = qlens.cumsum()
        positions = (np.arange(int(ends[-1]), dtype=_I32) + (start - (ends - qlens)).repeat(qlens)).astype(_I32, copy=False)
        reqs = batch.reqs
        chunk_tokens = [reqs[r].tokens[s0 : s0 + c] for s0, r, c in zip(start[n_dec:].tolist(), b.rows, b.chunks)]
    decoding = rows[:n_dec]
    pending = batch.pending[decoding] if fed else None
    if pending is None or not pending.any():
        tokens, feedback = batch.last[decoding], np.zeros(rows.shape[0], dtype=np.uint8)
    elif everyone and pending.all():
        tokens, feedback = snap.zeros, snap.ones_u8
    else:
        fed_rows = pending > 0
        tokens = np.where(fed_rows, 0, batch.last[decoding])
        feedback = np.concatenate((fed_rows, np.zeros(len(b.rows), dtype=bool))).astype(np.uint8)
    token_ids = np.concatenate([tokens, *chunk_tokens]).astype(_I32, copy=False) if chunk_tokens else tokens.astype(_I32)
    context_lens = start + qlens
    if everyone:
        sample = snap.ones_u8
    else:
        known = batch.ntok[rows] + batch.pending[rows] if fed else batch.ntok[rows]
        sample = (context_lens == known).astype(np.uint8)
    lens = batch.npages[rows]
    base = batch.sent[rows]
    # Executors forget a sequence absent from a step.
    if not everyone:
        batch.sent[:n] = 0
    batch.sent[rows] = lens
    if batch.num_processed:
        processing = _processed(batch, rows, base, sample)
    elif everyone:
        processing = _unprocessed(snap.zeros, snap.zeros_u8)
    else:
        processing = _unprocessed(np.zeros(rows.shape[0], dtype=_I32), np.zeros(rows.shape[0], dtype=np.uint8))
    return dict(
        rows=rows, query_lens=qlens, context_lens=context_lens, token_ids=token_ids, positions=positions,
        page_table_lens=lens, page_table_base=base, page_table=_new_pages(batch, rows, base, lens), sample=sample,
        feedback=feedback, **{field: columns[column] for field, column in ROW_COLUMNS.items()}, **processing,
    )


def _continued(
    batch: Batch, step: int, dec_rows: np.ndarray | None, b: StepBuilder, cleared: np.ndarray, poison: np.ndarray,
    prev: StepPlan | None, forwards: int,
) -> Continue | None:
    """The CONTINUE that says this step, when it is the step before's: every row decoding the token
    that step samples for it, the rows unchanged since (the same ids in the same order),
    nothing restored or offloaded, no stop token banned, each page table at most one page longer.
    Anything else (an admission, a row that ended, a step aborted between) is a PREPARE."""
    if dec_rows is not None or prev is None or prev.step != step - 1 or b.restore_pages or b.offload_pages:
        return None
    n = batch.n
    pending = batch.pending[:n]
    # Every row feeds back the sample of the step before: in flight (pending), or ended, when the
    # ranks still hold it (Steps.base) and its tokens are known here.
    if not (pending.all() or not pending.any()):
        return None
    # The same rows in the same order: the same snapshot, or (the step before admitted them) the
    # same ids.
    ids, held = batch.snapshot().columns["req_id"], prev.prepare.seq_ids
    if held is not ids and not (np.array_equal(held, ids) and prev.prepare.sample.all()):
        return None
    if batch.num_processed:
        min_len = batch.min_len[:n]
        if ((min_len > 0) & (batch.ntok[:n] + batch.pending[:n] < min_len)).any():
            return None
    lens, base = batch.npages[:n], batch.sent[:n]
    grown = lens - base
    at = grown.nonzero()[0]
    if at.shape[0] != int(grown.sum()):
        return None
    new_pages = np.full(n, -1, dtype=_I32)
    new_pages[at] = batch.pages[at, base[at]]
    batch.sent[:n] = lens
    return Continue(new_pages, cleared, poison, forwards)


def assemble(
    batch: Batch, step: int, dec_rows: np.ndarray | None, b: StepBuilder, poison: np.ndarray, prev: StepPlan | None,
    forwards: int = 1, first_row_end: int = 1,
) -> StepPlan:
    """The PREPARE of the step: every batch row decoding (dec_rows None) or dec_rows then b.rows.
    prev: the step the ranks ran or run last (Steps.base), whose samples rows may feed back;
    forwards: its decode_steps; first_row_end: StepPlan's.
    The rows advance by what they compute, and count the samples the step will produce."""
    cleared = cat(b.cleared)
    if cleared.shape[0] > 1:
        cleared.sort()
    brief = _continued(batch, step, dec_rows, b, cleared, poison, prev, forwards)
    if brief is not None:
        rows = batch.snapshot().rows  # every row, in batch order: the ids _continued compared
        prepare = expand(prev.prepare, brief)
    else:
        a = _arrays(batch, dec_rows, b, prev is not None)
        rows = a.pop("rows")
        prepare = Prepare(
            **a,
            cleared_pages=cleared,
            restore_pages=cat(b.restore_pages),
            restore_slots=np.array(b.restore_slots, dtype=_I32) if b.restore_slots else EMPTY_I32,
            offload_pages=cat(b.offload_pages),
            offload_slots=np.array(b.offload_slots, dtype=_I32) if b.offload_slots else EMPTY_I32,
            poison_pages=poison,
            decode_steps=forwards,
        )
    batch.ncomp[rows] = prepare.final_context_lens
    batch.pending[rows] += prepare.sample if forwards == 1 else forwards  # several: every row is sampled
    return StepPlan(
        step, prepare, rows, batch.moves, tuple(b.restore_slots), tuple(b.restored), tuple(b.offloaded), brief,
        first_row_end,
    )
