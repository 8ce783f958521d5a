"""Typed frames of the wire protocol.

Every frame is a frozen dataclass. Integer and float arrays are numpy arrays with a fixed dtype
(see ARRAY_DTYPES): the codec sends them as raw little-endian buffers, one after the other in one
ZeroMQ part, and decodes them zero-copy, so they are read-only on the receiving side.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

# 2: PREPARE carries page-table deltas (page_table_base) instead of whole page tables.
# 3: one name per setting in CacheGeometry (vLLM's: num_kv_pages, max_model_len, max_num_seqs,
#    max_num_batched_tokens, num_host_pages); PREPARE's `feedback` (a decode row's token is the one the
#    executors sampled for it at the step before, so a step can be planned while that one runs);
#    REJECT's `seq_ids` (the sequences a rank refuses, so that only their requests fail); PREPARE's
#    logits processing (alternatives wanted, penalties, logit bias, banned tokens and the sampling
#    state rank 0 holds between steps) and RESULT's top alternatives, added before anything outside
#    this repository spoke version 3; then min_p and each sequence's output grammar (protocol/grammar.py),
#    sent with its sampling state, before anything outside this repository spoke it either.
# 4: every array of a frame in one payload part (offsets from the lengths the envelope lists, in
#    ARRAY_DTYPES' order, 8-byte aligned) instead of one ZeroMQ part per array.
# 5: the envelope, payload and MAC in one ZeroMQ message behind a header of their lengths
#    (codec.to_message) instead of three parts.
# 6: WELCOME's ready_is_go: a group of one rank runs each step on its own READY, without a GO.
# 7: CONTINUE, a steady decode step as three arrays: the rows of the step before, one token on each
#    (protocol/continuation.py).
# 8: RESULT's ready_next: a lone rank that receives step N+1 while N runs answers READY for N+1 in
#    N's RESULT instead of a frame of its own.
# 9: PREPARE's and CONTINUE's decode_steps: a steady decode step runs several forwards on one frame,
#    each sequence decoding its own sample of the forward before (docs/control_plane.md), and its
#    RESULT carries every forward's samples; CUT ends such a step after the forward running.
PROTOCOL_VERSION = 9
# The most forwards one frame may ask for. A CONTINUE grows each table by one page at most, so a
# frame's forwards may not span more than one page boundary: decode_steps <= page_size as well.
MAX_DECODE_STEPS = 32


def max_decode_steps(page_size: int) -> int:
    """The most forwards a step may ask for with pages of `page_size` slots."""
    return min(page_size, MAX_DECODE_STEPS)
# Cache layout version: what a page id means in the executors' cache planes (DESIGN.md: one page is
# one contiguous range across every layer's K and V plane, plus one reserved all-zero pad page).
LAYOUT_VERSION = 1
SUPPORTED_VERSIONS: tuple[int, ...] = (PROTOCOL_VERSION,)


class FrameType(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    PREPARE = 3
    READY = 4
    REJECT = 5
    GO = 6
    ABORT = 7
    RESULT = 8
    DONE = 9
    HEARTBEAT = 10
    SHUTDOWN = 11
    CONTINUE = 12
    CUT = 13


class KVDtype(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8_E4M3 = "fp8-e4m3"


@dataclass(frozen=True)
class CacheGeometry:
    """What every rank agrees on at the handshake; PREPARE frames are validated against it."""

    num_kv_pages: int
    page_size: int
    num_layers: int
    num_kv_heads: int  # total over all ranks
    head_dim: int
    kv_dtype: str  # a KVDtype value
    vocab_size: int
    max_model_len: int  # positions must be < max_model_len
    max_num_seqs: int  # sequences per step
    max_num_batched_tokens: int  # new tokens per step, summed over sequences
    num_host_pages: int = 0  # pages of host offload buffer

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)


@dataclass(frozen=True)
class Hello:
    """Executor -> scheduler, once, before anything else."""

    rank: int
    world_size: int
    versions: tuple[int, ...]
    layout: int
    model_fingerprint: str
    geometry: CacheGeometry
    # A digest of the options every rank must share (dtype, weight format, debug switches...):
    # hosts launched with different flags are refused at the handshake, naming the host.
    config_fingerprint: str = ""
    host: str = ""  # the rank's host name, for errors that must say which machine disagrees


@dataclass(frozen=True)
class Welcome:
    """Scheduler -> executor: the negotiated version and the geometry every rank uses.

    ready_is_go: the rank runs each step as soon as it has answered READY, and no GO is sent. Only
    for a group of one rank, whose own READY is the whole group's: GO would carry nothing, and it
    costs a frame each way per step on both sides' hot path (docs/control_plane.md)."""

    version: int
    layout: int
    world_size: int
    geometry: CacheGeometry
    ready_is_go: bool = False


@dataclass(frozen=True)
class Prepare:
    """Scheduler -> every executor: one step.

    Sequence i contributes query_lens[i] new tokens, whose ids and positions are the slice
    token_ids[q0:q0+query_lens[i]] (q0 = sum of earlier query_lens); after the step it is
    context_lens[i] tokens long. Its page table has page_table_lens[i] pages: the first
    page_table_base[i] are the ones the executors hold for it from the previous step, the rest are
    page_table[p0:p0+page_table_lens[i]-page_table_base[i]]. A base of 0 sends the whole table.
    Executors hold the tables of the sequences of their last PREPARE only (protocol.page_tables).
    sample[i] says whether the logits of its last new token are sampled this step (a prefill chunk
    that does not reach the prompt's end is not sampled). feedback[i] = 1 says that its one new token
    is the token the executors sampled for it at the step they ran before this one (its entry in
    token_ids is a placeholder 0): the scheduler plans this step before that one's RESULT is in.

    Before the forward, in this order: offload_pages -> host offload_slots; poison_pages filled with
    0xFF (debug fault injection); host restore_slots -> restore_pages; cleared_pages zeroed.

    Logits processing, on rank 0, of each sampled row before temperature, top-k and top-p (vLLM's
    order: logit bias and banned tokens, then repetition, frequency and presence penalties).
    num_logprobs[i] alternatives come back with the sample. The penalties count the tokens of the
    sequence's sampling state, which rank 0 holds between steps as page tables are held:
    sampling_state[i] is 0 (none: no penalty, no bias), 1 (sent whole here: history_lens[i] tokens
    of `history`, the first history_prompt_lens[i] of them the prompt's and the rest its output so
    far, and logit_bias_lens[i] entries of logit_bias_ids/logit_bias; it replaces what was held)
    or 2 (held from the previous step, which rank 0 extended with the tokens it sampled). A
    sequence absent from a step is forgotten; an ABORT forgets every state. banned_ids are the
    tokens this step's sample may not be (a request's stop tokens before its min_tokens).

    min_p[i] drops, after temperature, every token less likely than min_p times the row's most likely
    one (0: off). A sequence whose output follows a grammar has a sampling state: its grammar
    (grammar_lens[i] bytes of `grammar`, protocol/grammar.py's encoding) travels with it, whole, and
    rank 0 masks the sampled row with the tokens the grammar allows after the output so far.

    decode_steps > 1 runs the step as that many forwards, back to back on the ranks, with no frame
    between them: the one the arrays describe, then decode_steps - 1 more in which every sequence
    decodes the token it sampled in the forward before, one position on. Only a plain decode step
    may ask for it (one new token per sequence, every sequence sampled, no token banned), and each
    page table must hold the context after the last forward (final_context_lens): its pages are
    in this step's cleared_pages when they are new, zeroed before the first forward.
    """

    seq_ids: np.ndarray  # int64[n]
    query_lens: np.ndarray  # int32[n]
    context_lens: np.ndarray  # int32[n]
    token_ids: np.ndarray  # int32[T]
    positions: np.ndarray  # int32[T]
    page_table_lens: np.ndarray  # int32[n]: pages in each page table after the step
    page_table_base: np.ndarray  # int32[n]: pages of it the executors already hold
    page_table: np.ndarray  # int32[sum(page_table_lens - page_table_base)]: the others
    sample: np.ndarray  # uint8[n]
    temperature: np.ndarray  # float32[n]; 0 means greedy
    top_p: np.ndarray  # float32[n]; 1 means off
    top_k: np.ndarray  # int32[n]; 0 means off
    seeds: np.ndarray  # int64[n]; -1 means unseeded
    cleared_pages: np.ndarray  # int32[], sorted, unique
    restore_pages: np.ndarray  # int32[r]
    restore_slots: np.ndarray  # int32[r]
    offload_pages: np.ndarray  # int32[o]
    offload_slots: np.ndarray  # int32[o]
    poison_pages: np.ndarray  # int32[], debug: pages that returned to the free pool
    feedback: np.ndarray  # uint8[n]; 1: the new token is this sequence's sample of the step before
    num_logprobs: np.ndarray  # uint8[n]: alternatives to return with the sample (0..20)
    presence_penalty: np.ndarray  # float32[n]; 0 means off
    frequency_penalty: np.ndarray  # float32[n]; 0 means off
    repetition_penalty: np.ndarray  # float32[n]; 1 means off
    sampling_state: np.ndarray  # uint8[n]; 0 none, 1 sent whole in this PREPARE, 2 held
    history_lens: np.ndarray  # int32[n]: tokens of the history sent here (state 1 only)
    history_prompt_lens: np.ndarray  # int32[n]: how many of them are the prompt's
    history: np.ndarray  # int32[sum(history_lens)]
    logit_bias_lens: np.ndarray  # int32[n]: logit bias entries sent here (state 1 only)
    logit_bias_ids: np.ndarray  # int32[sum(logit_bias_lens)]; strictly increasing per sequence
    logit_bias: np.ndarray  # float32[sum(logit_bias_lens)]: added to those tokens' logits
    banned_lens: np.ndarray  # int32[n]: tokens this step's sample may not be
    banned_ids: np.ndarray  # int32[sum(banned_lens)]
    min_p: np.ndarray  # float32[n]; 0 means off
    grammar_lens: np.ndarray  # int32[n]: bytes of the grammar sent here (state 1 only)
    grammar: np.ndarray  # uint8[sum(grammar_lens)]
    decode_steps: int = 1

    @property
    def final_context_lens(self) -> np.ndarray:
        """Each sequence's context after the step's last forward: context_lens itself for one
        forward, else summed in int64 (where no wire value can wrap it)."""
        if self.decode_steps == 1:
            return self.context_lens
        return self.context_lens.astype(np.int64) + (self.decode_steps - 1)

    @classmethod
    def greedy(
        cls,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        token_ids: np.ndarray,
        page_table_lens: np.ndarray,
        page_table: np.ndarray,
        *,
        seq_ids: np.ndarray | None = None,
        sample: np.ndarray | None = None,
        cleared_pages: np.ndarray | None = None,
    ) -> Prepare:
        """A greedy step with whole page tables and no restores, offloads or poison: the step that
        graph capture, benchmarks and tests build by hand. Each sequence's new tokens take the
        last query_lens[i] positions of its context; every sequence is sampled unless `sample`."""
        i32 = np.dtype("<i4")
        query = np.asarray(query_lens, dtype=i32)
        context = np.asarray(context_lens, dtype=i32)
        n = query.shape[0]
        ends = np.cumsum(query)
        positions = np.arange(int(ends[-1]) if n else 0, dtype=i32) + np.repeat(context - ends, query)
        arrays = unused_fields(n)
        arrays.update(
            query_lens=query,
            context_lens=context,
            token_ids=np.asarray(token_ids, dtype=i32),
            positions=positions.astype(i32),
            page_table_lens=np.asarray(page_table_lens, dtype=i32),
            page_table=np.asarray(page_table, dtype=i32),
        )
        if seq_ids is None:
            arrays["seq_ids"] = np.arange(n, dtype=np.int64)
        else:
            arrays["seq_ids"] = np.asarray(seq_ids, dtype=np.int64)
        if sample is not None:
            arrays["sample"] = np.asarray(sample, dtype=np.uint8)
        if cleared_pages is not None:
            arrays["cleared_pages"] = np.asarray(cleared_pages, dtype=i32)
        return cls(**arrays)

    @classmethod
    def greedy_decode(
        cls, context_lens: np.ndarray, token_ids: np.ndarray, page_table_lens: np.ndarray, page_table: np.ndarray
    ) -> Prepare:
        """One new token per sequence: the decode step graph capture and device checks build."""
        n = len(context_lens)
        return cls.greedy(np.ones(n), context_lens, token_ids, page_table_lens, page_table)


@dataclass(frozen=True)
class Continue:
    """Scheduler -> every executor: a step that is the step before's sequences, each one token on.

    It stands for the PREPARE that protocol.continuation.expand builds from the last PREPARE the
    executor accepted (which must be the step before this one's) and these arrays: every sequence
    decodes the token sampled for it at that step (feedback), with the same sampling parameters,
    its sampling state held, and new_pages[i] appended to its page table (-1: none); decode_steps as
    PREPARE's (its forwards continue from the last forward of the step before). Steady decode
    is nearly every step a server runs, and its PREPARE's 36 arrays cost the scheduler more Python
    to encode than anything else it does per step (docs/control_plane.md)."""

    new_pages: np.ndarray  # int32[n]: the page each sequence's table gains, -1 for none
    cleared_pages: np.ndarray  # int32[], sorted, unique: as PREPARE's
    poison_pages: np.ndarray  # int32[]: as PREPARE's
    decode_steps: int = 1


@dataclass(frozen=True)
class Ready:
    rank: int


def _no_seq_ids() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


def _no_token_ids() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


def _no_logprobs() -> np.ndarray:
    return np.zeros(0, dtype=np.float32)


@dataclass(frozen=True)
class Reject:
    """A rank refuses a frame. `seq_ids` names the sequences whose own fields broke a rule, when
    the frame is otherwise sound: only their requests fail and the step is planned again without
    them. Empty: the whole frame is refused."""

    rank: int
    code: int  # a protocol.errors.RejectCode
    message: str
    seq_ids: np.ndarray = field(default_factory=_no_seq_ids)  # int64[k]


@dataclass(frozen=True)
class Go:
    pass


@dataclass(frozen=True)
class Abort:
    reason: str


@dataclass(frozen=True)
class Cut:
    """Scheduler -> every executor: the step in the envelope, a step of several forwards that runs,
    ends after the forward running now (a request arrived, which would otherwise wait for all of
    them). Rank 0 decides where, and tells the other ranks with the tokens it feeds the next
    forward, so that every rank runs the same collectives; its RESULT carries the forwards that
    ran. A CUT for a step not running, or on its last forward, changes nothing: it may cross the
    step's RESULT on the wire."""


@dataclass(frozen=True)
class Result:
    """Rank 0 -> scheduler after the forward: one row per sequence with sample[i] set, in seq_ids;
    token_ids, logprobs and finite hold one entry per row and forward, forward by forward (a step of
    decode_steps d has d * m of each: the first forward's m rows, then the second's).

    top_token_ids/top_logprobs: the num_logprobs[i] most likely tokens of each sampled row (in the
    PREPARE's num_logprobs, row by row, most likely first, forward by forward) and their
    log-probabilities, from the distribution the token was drawn from."""

    seq_ids: np.ndarray  # int64[m]
    token_ids: np.ndarray  # int32[d * m]
    logprobs: np.ndarray  # float32[d * m]
    finite: np.ndarray  # uint8[d * m]; 0: the logits row had a NaN or inf, token_ids[i] is meaningless
    step_time_us: int = 0
    # How long rank 0's model sat idle between the end of its previous step and this one's GO: the
    # share of the control plane (planning, PREPARE, READY, GO) that the model waited for.
    gap_us: int = 0
    top_token_ids: np.ndarray = field(default_factory=_no_token_ids)  # int32[sum(num_logprobs of sampled rows)]
    top_logprobs: np.ndarray = field(default_factory=_no_logprobs)  # float32[same]
    # READY for step + 1, from a lone rank (WELCOME's ready_is_go) that received that step while
    # this one ran: it rides here instead of costing a frame each way per step.
    ready_next: bool = False

    @property
    def forwards(self) -> int:
        """The forwards whose samples it carries: the step's decode_steps, or fewer where it was cut
        (1 for a step that sampled no row)."""
        rows = self.seq_ids.shape[0]
        return self.token_ids.shape[0] // rows if rows else 1


@dataclass(frozen=True)
class Done:
    """Ranks other than 0 -> scheduler after the forward."""

    rank: int


@dataclass(frozen=True)
class Heartbeat:
    rank: int  # -1 for the scheduler


@dataclass(frozen=True)
class Shutdown:
    reason: str


Body = Hello | Welcome | Prepare | Ready | Reject | Go | Abort | Result | Done | Heartbeat | Shutdown | Continue | Cut

BODY_TYPES: dict[FrameType, type] = {
    FrameType.HELLO: Hello,
    FrameType.WELCOME: Welcome,
    FrameType.PREPARE: Prepare,
    FrameType.READY: Ready,
    FrameType.REJECT: Reject,
    FrameType.GO: Go,
    FrameType.ABORT: Abort,
    FrameType.RESULT: Result,
    FrameType.DONE: Done,
    FrameType.HEARTBEAT: Heartbeat,
    FrameType.SHUTDOWN: Shutdown,
    FrameType.CONTINUE: Continue,
    FrameType.CUT: Cut,
}
FRAME_TYPE_OF: dict[type, FrameType] = {cls: t for t, cls in BODY_TYPES.items()}

class Extent(enum.Enum):
    """How long a PREPARE array is."""

    SEQUENCE = "sequence"  # one entry per sequence: len(seq_ids)
    TOKEN = "token"  # one entry per new token: sum(query_lens)
    COUNTED = "counted"  # each sequence's entries in turn, as many as its `counts` field says
    LIST = "list"  # a list of its own length (pages, host slots), or as long as `counts` when set


@dataclass(frozen=True)
class ArrayField:
    """One array field of PREPARE, declared once: the codec's dtype, the validator's length rule,
    and the value a sequence that uses none of it takes (hand-built steps, the scheduler's rows
    without logits processing). A field added here is carried, checked and defaulted everywhere."""

    name: str
    dtype: np.dtype
    extent: Extent
    default: int | float = 0
    counts: str | None = None  # COUNTED: the per-sequence count field; LIST: the list it pairs with


_I32, _I64, _U8, _F32 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("u1"), np.dtype("<f4")
_SEQ, _TOKEN, _COUNTED, _LIST = Extent.SEQUENCE, Extent.TOKEN, Extent.COUNTED, Extent.LIST

# In Prepare's field order (a test holds the two together).
PREPARE_FIELDS: tuple[ArrayField, ...] = (
    ArrayField("seq_ids", _I64, _SEQ),
    ArrayField("query_lens", _I32, _SEQ, 1),
    ArrayField("context_lens", _I32, _SEQ),
    ArrayField("token_ids", _I32, _TOKEN),
    ArrayField("positions", _I32, _TOKEN),
    ArrayField("page_table_lens", _I32, _SEQ),
    ArrayField("page_table_base", _I32, _SEQ),
    # sum(page_table_lens - page_table_base) entries: the validator's own rule.
    ArrayField("page_table", _I32, _LIST),
    ArrayField("sample", _U8, _SEQ, 1),
    ArrayField("temperature", _F32, _SEQ, 0.0),
    ArrayField("top_p", _F32, _SEQ, 1.0),
    ArrayField("top_k", _I32, _SEQ, 0),
    ArrayField("seeds", _I64, _SEQ, -1),
    ArrayField("cleared_pages", _I32, _LIST),
    ArrayField("restore_pages", _I32, _LIST),
    ArrayField("restore_slots", _I32, _LIST, counts="restore_pages"),
    ArrayField("offload_pages", _I32, _LIST),
    ArrayField("offload_slots", _I32, _LIST, counts="offload_pages"),
    ArrayField("poison_pages", _I32, _LIST),
    ArrayField("feedback", _U8, _SEQ, 0),
    ArrayField("num_logprobs", _U8, _SEQ, 0),
    ArrayField("presence_penalty", _F32, _SEQ, 0.0),
    ArrayField("frequency_penalty", _F32, _SEQ, 0.0),
    ArrayField("repetition_penalty", _F32, _SEQ, 1.0),
    ArrayField("sampling_state", _U8, _SEQ, 0),
    ArrayField("history_lens", _I32, _SEQ, 0),
    ArrayField("history_prompt_lens", _I32, _SEQ, 0),
    ArrayField("history", _I32, _COUNTED, counts="history_lens"),
    ArrayField("logit_bias_lens", _I32, _SEQ, 0),
    ArrayField("logit_bias_ids", _I32, _COUNTED, counts="logit_bias_lens"),
    ArrayField("logit_bias", _F32, _COUNTED, counts="logit_bias_lens"),
    ArrayField("banned_lens", _I32, _SEQ, 0),
    ArrayField("banned_ids", _I32, _COUNTED, counts="banned_lens"),
    ArrayField("min_p", _F32, _SEQ, 0.0),
    ArrayField("grammar_lens", _I32, _SEQ, 0),
    ArrayField("grammar", _U8, _COUNTED, counts="grammar_lens"),
)
PREPARE_FIELD = {f.name: f for f in PREPARE_FIELDS}
# The logits-processing fields: what a sequence that uses none of it sends (plain_sampling).
PROCESSING_FIELDS = tuple(PREPARE_FIELDS[[f.name for f in PREPARE_FIELDS].index("num_logprobs") :])


def unused_fields(n: int, fields: tuple[ArrayField, ...] = PREPARE_FIELDS) -> dict[str, np.ndarray]:
    """`fields` as n sequences that use none of them: each per-sequence field at its default,
    every other array empty."""
    return {f.name: np.full(n if f.extent is Extent.SEQUENCE else 0, f.default, dtype=f.dtype) for f in fields}


def plain_sampling(n: int) -> dict[str, np.ndarray]:
    """PREPARE's logits-processing fields for n sequences that use none of it: no alternatives, no
    penalties, no sampling state, nothing banned. For PREPAREs built by hand."""
    return unused_fields(n, PROCESSING_FIELDS)


# The dtype of every array field, by frame class and field name. Anything else is a scalar.
ARRAY_DTYPES: dict[type, dict[str, np.dtype]] = {
    Prepare: {f.name: f.dtype for f in PREPARE_FIELDS},
    Continue: {"new_pages": _I32, "cleared_pages": _I32, "poison_pages": _I32},
    Reject: {"seq_ids": np.dtype("<i8")},
    Result: {
        "seq_ids": np.dtype("<i8"),
        "token_ids": np.dtype("<i4"),
        "logprobs": np.dtype("<f4"),
        "finite": np.dtype("u1"),
        "top_token_ids": np.dtype("<i4"),
        "top_logprobs": np.dtype("<f4"),
    },
}


@dataclass(frozen=True)
class Frame:
    """A whole frame: the envelope fields and one body.

    `seq` is the sender's frame counter, strictly increasing per sender and connection: the receiver
    rejects a frame whose seq is not above the last one it accepted from that sender (replay).
    """

    version: int
    layout: int
    run_id: str
    step: int
    seq: int
    body: Body

    @property
    def type(self) -> FrameType:
        return FRAME_TYPE_OF[type(self.body)]
