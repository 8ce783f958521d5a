"""A frame fuzzer with the launch's key, against live executors driven by a `FrameDriver`.

Two kinds of frames, each checked against what the protocol requires of every rank:
- body mutations (`body_mutations`, a hypothesis strategy): a valid PREPARE for the geometry with
  one field changed: one entry or all of them set to an extreme of the field's dtype (INT32_MIN and
  MAX, the geometry's own limits and one past them, NaN, +-inf, denormals, the sampler's floors),
  truncated, extended, oversized past max_num_seqs or emptied. Encoded as the codec encodes it,
  every rank must answer alike: READY (the frame is sound; it then runs, and its RESULT must be
  well-formed) or REJECT with a code, naming only sequences of the frame when it names any.
- wire cases (`wire_cases`, a fixed list run whole): parts the codec never makes, re-signed with the
  key so they get past the MAC (a payload shorter or longer than its array listing, an array in
  another field's dtype, missing and extra parts, a truncated or oversized envelope, frames over the
  size limit), every envelope field (version, layout, run id, step, seq: replays), frames of types the
  scheduler never sends, and frames that fail the MAC. Each names the one code every rank must
  answer with, or None for a frame the protocol ignores (a HEARTBEAT: no answer at all).

After either, the caller runs `good_prepare` again: a rank that survived the frames gives the same
token as before them (`check_good_step`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
from hypothesis import strategies as st

from protocol.conversation import StepDone, StepRefused
from protocol.errors import RejectCode
from protocol.frames import (
    ARRAY_DTYPES,
    PROTOCOL_VERSION,
    CacheGeometry,
    Done,
    FrameType,
    Go,
    Heartbeat,
    Hello,
    Prepare,
    Ready,
    Reject,
    Result,
    Welcome,
    plain_sampling,
)
from protocol.sampling_limits import FLOAT32_MAX, TEMPERATURE_MIN, TOP_P_MIN
from scripts.harness.frame_driver import FrameDriver, Sent

PREPARE_DTYPES = ARRAY_DTYPES[Prepare]
FIELDS = tuple(sorted(PREPARE_DTYPES))
PAYLOAD_ALIGN = 8  # docs/protocol.md: each array starts at a multiple of 8 bytes of the payload
KINDS = ("one", "all", "truncate", "extend", "huge", "empty")
I32 = np.iinfo(np.int32)
I64 = np.iinfo(np.int64)


def extremes(g: CacheGeometry) -> dict[str, list]:
    """Values worth trying, by dtype: the type's limits, the geometry's limits and their neighbours."""
    return {
        "i4": [I32.min, I32.min + 1, -1, 0, 1, I32.max, I32.max - 1, g.num_kv_pages, g.num_kv_pages - 1,
               g.max_model_len, g.max_model_len + 1, g.vocab_size, g.page_size, g.max_pages_per_seq + 1,
               g.num_host_pages, g.max_num_batched_tokens + 1],
        "i8": [I64.min, -2, -1, 0, 1000, I64.max],
        "f4": [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, 1e-40, 5e-6, TEMPERATURE_MIN, TOP_P_MIN, 1.0, 1.0000001,
               FLOAT32_MAX, -1.0],
        "u1": [0, 1, 2, 255],
    }  # fmt: skip


def _arr(name: str, values: object) -> np.ndarray:
    return np.asarray(values, dtype=PREPARE_DTYPES[name])


@st.composite
def valid_prepares(draw, g: CacheGeometry) -> Prepare:
    """A PREPARE that passes every rule for `g`: whole page tables (base 0), cleared pages sorted
    and unique, restore targets apart from them, host slots in range, mixed sampling."""
    n = draw(st.integers(1, min(4, g.max_num_seqs)))
    budget = g.max_num_batched_tokens
    query, context = [], []
    for _ in range(n):
        q = draw(st.integers(1, max(1, min(8, budget - (n - len(query) - 1)))))
        budget -= q
        query.append(q)
        context.append(draw(st.integers(q, g.max_model_len)))
    lens = [-(-c // g.page_size) for c in context]
    table = [draw(st.integers(0, g.num_kv_pages - 1)) for _ in range(sum(lens))]
    spare = draw(st.lists(st.integers(0, g.num_kv_pages - 1), unique=True, max_size=8))
    cleared = sorted(set(spare[:4]) | set(table[:2]))
    others = [p for p in spare[4:] if p not in cleared]
    slots = list(range(g.num_host_pages))
    restore = list(zip(others[:2], slots[:2]))
    offload = list(zip(others[2:3], slots[2:3]))
    positions = [c - q + j for q, c in zip(query, context) for j in range(q)]
    return Prepare(
        seq_ids=_arr("seq_ids", [100 + i for i in range(n)]),
        query_lens=_arr("query_lens", query),
        context_lens=_arr("context_lens", context),
        token_ids=_arr("token_ids", [draw(st.integers(0, g.vocab_size - 1)) for _ in range(sum(query))]),
        positions=_arr("positions", positions),
        page_table_lens=_arr("page_table_lens", lens),
        page_table_base=_arr("page_table_base", [0] * n),
        page_table=_arr("page_table", table),
        sample=_arr("sample", [1] * n),
        temperature=_arr("temperature", [draw(st.sampled_from([0.0, 0.7, 1.3])) for _ in range(n)]),
        top_p=_arr("top_p", [draw(st.sampled_from([1.0, 0.9])) for _ in range(n)]),
        top_k=_arr("top_k", [draw(st.sampled_from([0, 5])) for _ in range(n)]),
        seeds=_arr("seeds", [draw(st.sampled_from([-1, 7])) for _ in range(n)]),
        cleared_pages=_arr("cleared_pages", cleared),
        restore_pages=_arr("restore_pages", [p for p, _ in restore]),
        restore_slots=_arr("restore_slots", [s for _, s in restore]),
        offload_pages=_arr("offload_pages", [p for p, _ in offload]),
        offload_slots=_arr("offload_slots", [s for _, s in offload]),
        poison_pages=_arr("poison_pages", others[3:4]),
        feedback=_arr("feedback", [0] * n),
        **plain_sampling(n),
    )


@dataclass(frozen=True)
class BodyMutation:
    field: str
    kind: str  # one of KINDS
    value: str  # the extreme written, as repr
    prepare: Prepare

    def describe(self) -> str:
        return f"{self.field} {self.kind} {self.value}"


@st.composite
def body_mutations(draw, g: CacheGeometry) -> BodyMutation:
    p = draw(valid_prepares(g))
    name = draw(st.sampled_from(FIELDS))
    dtype = PREPARE_DTYPES[name]
    values = getattr(p, name).copy()
    extreme = draw(st.sampled_from(extremes(g)[dtype.str.lstrip("<|")]))
    kind = draw(st.sampled_from(KINDS))
    with np.errstate(over="ignore", invalid="ignore"):
        if kind == "one" and values.size:
            values[draw(st.integers(0, values.size - 1))] = extreme
        elif kind == "all":
            values = np.full(values.size, extreme, dtype=dtype)
        elif kind == "truncate" and values.size:
            values = values[: draw(st.integers(0, values.size - 1))]
        elif kind == "extend":
            values = np.append(values, np.full(draw(st.integers(1, 3)), extreme, dtype=dtype)).astype(dtype)
        elif kind == "huge":
            values = np.full(draw(st.sampled_from([g.max_num_seqs + 1, 70_000])), extreme, dtype=dtype)
        elif kind == "empty":
            values = values[:0]
    mutated = dataclasses.replace(p, **{name: np.ascontiguousarray(values, dtype=dtype)})
    return BodyMutation(name, kind, repr(extreme), mutated)


def check_body_outcome(mutation: BodyMutation, sent: Sent, g: CacheGeometry, world_size: int) -> list[str]:
    """What is wrong with the ranks' answers to a body mutation (nothing: an empty list)."""
    problems = _one_answer_each(sent, world_size)
    if problems:
        return problems
    firsts = {rank: answers[0] for rank, answers in sent.answers.items()}
    kinds = {(a.kind, a.code, a.step, a.seq_ids) for a in firsts.values()}
    if len(kinds) != 1:
        return [f"the ranks disagree: {sorted(firsts.items())}"]
    answer = next(iter(firsts.values()))
    if answer.step != sent.step:
        problems.append(f"answered for step {answer.step}, the frame was step {sent.step}")
    if answer.kind == "REJECT":
        if answer.code is None:
            problems.append(f"a REJECT without a known code: {answer.message}")
        if not set(answer.seq_ids) <= set(mutation.prepare.seq_ids.tolist()):
            problems.append(f"REJECT names sequences {answer.seq_ids} that the frame does not hold")
        return problems
    if answer.kind != "READY":
        return [*problems, f"answered {answer.kind}"]
    return problems + check_result(mutation.prepare, sent.result, g)


def check_result(prepare: Prepare, result: Result | None, g: CacheGeometry) -> list[str]:
    """A RESULT that a step which passed validation may produce: one row per sampled sequence, a
    token in the vocabulary for every finite row."""
    if result is None:
        return ["every rank was READY but no RESULT came"]
    problems = []
    sampled = prepare.seq_ids[prepare.sample.astype(bool)]
    if result.seq_ids.tolist() != sampled.tolist():
        problems.append(f"RESULT rows {result.seq_ids.tolist()[:8]} are not the sampled sequences {sampled.tolist()[:8]}")
    finite = result.finite.astype(bool)
    tokens = result.token_ids[finite]
    if tokens.size and (tokens.min() < 0 or tokens.max() >= g.vocab_size):
        problems.append(f"a finite row sampled a token outside [0, {g.vocab_size}): {tokens.tolist()[:8]}")
    if not set(result.finite.tolist()) <= {0, 1}:
        problems.append(f"finite flags other than 0 and 1: {sorted(set(result.finite.tolist()))}")
    return problems


# -- wire cases ---------------------------------------------------------------------------------


Build = Callable[[FrameDriver, int, Prepare], list[list[bytes]]]


@dataclass(frozen=True)
class WireCase:
    name: str
    build: Build  # (driver, step, a valid PREPARE) -> the messages to send, each a list of parts
    expect: RejectCode | None  # every rank's REJECT code; None: the protocol ignores it (no answer)
    answer_step: Callable[[int], int] = lambda step: step  # the step the REJECT must carry

    @property
    def answered(self) -> bool:
        return self.expect is not None


def _parts(driver: FrameDriver, step: int, p: Prepare, **envelope: object) -> list[bytes]:
    return driver.stamp(p, step, **envelope)


def _replace_array(driver: FrameDriver, step: int, p: Prepare, name: str, raw: bytes, listed: int | None) -> list[list[bytes]]:
    """The PREPARE's parts with array `name`'s bytes in the payload replaced by `raw` (padded as the
    wire pads an array) and, when `listed` is given, its length in the listing set to it. The offsets
    are worked out here from docs/protocol.md, as a peer in another language would."""
    envelope, payload, _ = _parts(driver, step, p)
    env = msgpack.unpackb(envelope)
    offset = 0
    for field, length in zip(PREPARE_DTYPES, env["arrays"]):
        size = length * PREPARE_DTYPES[field].itemsize
        padded = size + (-size % PAYLOAD_ALIGN)
        if field == name:
            payload = payload[:offset] + raw + bytes(-len(raw) % PAYLOAD_ALIGN) + payload[offset + padded :]
            break
        offset += padded
    if listed is not None:
        env["arrays"][list(PREPARE_DTYPES).index(name)] = listed
    return [driver.resign([msgpack.packb(env, use_bin_type=True), payload, b""])]


def _payload(change: Callable[[bytes], bytes]) -> Build:
    """Parts whose payload is change(the right one), re-signed."""

    def build(d: FrameDriver, s: int, p: Prepare) -> list[list[bytes]]:
        envelope, payload, _ = _parts(d, s, p)
        return [d.resign([envelope, change(payload), b""])]

    return build


def _rebuild(envelope_of: Callable[[dict], object]) -> Build:
    """Parts whose envelope is envelope_of(the right one), re-signed."""
    return lambda d, s, p: [d.repack(_parts(d, s, p), envelope_of)]


def _edit(change: Callable[[dict], None]) -> Build:
    """Parts whose envelope `change` edited in place, re-signed."""

    def edited(env: dict) -> dict:
        change(env)
        return env

    return _rebuild(edited)


def _set(key: str, value: object) -> Callable[[dict], None]:
    return lambda env: env.__setitem__(key, value)


def _other_body(body: object) -> Build:
    return lambda d, s, p: [d.stamp(body, s)]


def _replayed(d: FrameDriver, s: int, p: Prepare) -> list[list[bytes]]:
    beat = d.stamp(Heartbeat(-1), 0)
    return [beat, beat]  # the second copy carries a seq already accepted


def _older_seq(d: FrameDriver, s: int, p: Prepare) -> list[list[bytes]]:
    old = d.stamp(p, s)
    return [d.stamp(Heartbeat(-1), 0), old]  # stamped before the heartbeat, sent after it


def _unsigned(d: FrameDriver, s: int, p: Prepare) -> list[list[bytes]]:
    parts = _parts(d, s, p)
    parts[-1] = bytes(b ^ 0x5A for b in parts[-1])
    return [parts]


def _mac_over_another_payload(d: FrameDriver, s: int, p: Prepare) -> list[list[bytes]]:
    envelope, payload, mac = _parts(d, s, p)
    return [[envelope, payload + bytes(8), mac]]


def _too_many_parts(d: FrameDriver, s: int, p: Prepare) -> list[list[bytes]]:
    parts = _parts(d, s, p)
    return [d.resign([*parts[:-1], *([b""] * 20), b""])]


def _listing(change: Callable[[list], object]) -> Build:
    """Parts whose array listing `change` edited in place, re-signed."""

    def edited(env: dict) -> None:
        change(env["arrays"])

    return _edit(edited)


def wire_cases(g: CacheGeometry, big: bool = True) -> list[WireCase]:
    """Every wire case; `big` adds the two that send tens of megabytes (a frame over the size limit)."""
    tokens_as_int64 = lambda d, s, p: _replace_array(d, s, p, "token_ids", p.token_ids.astype("<i8").tobytes(), None)  # noqa: E731
    cases = [
        WireCase("mac_flipped", _unsigned, RejectCode.BAD_MAC),
        WireCase("mac_of_another_key", lambda d, s, p: [d.stamp(p, s, key=os.urandom(32))], RejectCode.BAD_MAC),
        WireCase("mac_missing", lambda d, s, p: [_parts(d, s, p)[:-1]], RejectCode.MALFORMED),  # two parts, not three
        WireCase("mac_over_another_payload", _mac_over_another_payload, RejectCode.BAD_MAC),
        WireCase("one_part", lambda d, s, p: [[b"\x93\x01\x02\x03"]], RejectCode.MALFORMED),
        WireCase("empty_part", lambda d, s, p: [[b""]], RejectCode.MALFORMED),
        WireCase("too_many_parts", _too_many_parts, RejectCode.TOO_LARGE),
        WireCase("envelope_over_1mib", _edit(lambda env: env["body"].__setitem__("pad", "x" * (1 << 20))), RejectCode.TOO_LARGE),
        WireCase("run_id_over_64kib", _edit(_set("run_id", "r" * 70_000)), RejectCode.TOO_LARGE),
        WireCase("envelope_truncated", lambda d, s, p: [d.resign([_parts(d, s, p)[0][:7], *_parts(d, s, p)[1:]])], RejectCode.MALFORMED),
        WireCase("envelope_not_msgpack", lambda d, s, p: [d.resign([b"\xc1\xc1\xc1", *_parts(d, s, p)[1:]])], RejectCode.MALFORMED),
        WireCase("envelope_a_list", _rebuild(lambda env: list(env.values())), RejectCode.MALFORMED),
        WireCase("envelope_extra_key", _edit(_set("extra", 1)), RejectCode.MALFORMED),
        WireCase("envelope_missing_seq", _edit(lambda env: env.__delitem__("seq")), RejectCode.MALFORMED),
        WireCase("envelope_binary_run_id", _edit(_set("run_id", b"bytes")), RejectCode.MALFORMED),
        WireCase("envelope_ext_value", _edit(_set("step", msgpack.ExtType(5, b"x"))), RejectCode.MALFORMED),
        WireCase("type_unknown", _edit(_set("type", 99)), RejectCode.MALFORMED),
        WireCase("type_hello_with_prepare_body", _edit(_set("type", int(FrameType.HELLO))), RejectCode.MALFORMED),
        WireCase("body_extra_field", _edit(lambda env: env["body"].__setitem__("x", 1)), RejectCode.MALFORMED),
        WireCase("step_a_string", _edit(_set("step", "1")), RejectCode.MALFORMED),
        WireCase("seq_a_float", _edit(_set("seq", 1.5)), RejectCode.MALFORMED),
        WireCase("version_a_bool", _edit(_set("version", True)), RejectCode.MALFORMED),
        WireCase("listing_length_plus_one", _listing(lambda a: a.__setitem__(0, a[0] + 1)), RejectCode.LENGTH_MISMATCH),
        WireCase("listing_length_negative", _listing(lambda a: a.__setitem__(0, -1)), RejectCode.MALFORMED),
        WireCase("listing_length_a_name", _listing(lambda a: a.__setitem__(0, "tokens")), RejectCode.MALFORMED),
        WireCase("listing_of_version_3_pairs", _listing(lambda a: a.__setitem__(0, ["seq_ids", a[0]])), RejectCode.MALFORMED),
        WireCase("listing_missing_entry", _listing(lambda a: a.pop()), RejectCode.MALFORMED),
        WireCase("payload_missing", lambda d, s, p: [d.resign([_parts(d, s, p)[0], b""])], RejectCode.MALFORMED),
        WireCase("part_extra", lambda d, s, p: [d.resign([*_parts(d, s, p)[:-1], b"\0" * 8, b""])], RejectCode.TOO_LARGE),
        WireCase("payload_one_byte_short", _payload(lambda b: b[:-1]), RejectCode.LENGTH_MISMATCH),
        WireCase("payload_one_byte_long", _payload(lambda b: b + b"\0"), RejectCode.LENGTH_MISMATCH),
        WireCase("array_bytes_of_int64", tokens_as_int64, RejectCode.LENGTH_MISMATCH),
        WireCase(
            "array_int64_relisted_as_int32",
            lambda d, s, p: _replace_array(d, s, p, "token_ids", p.token_ids.astype("<i8").tobytes(), 2 * len(p.token_ids)),
            RejectCode.LENGTH_MISMATCH,
        ),
        WireCase(
            "temperature_as_int32_bits",  # int32 1 read as float32 is 1.4e-45: under the sampler's floor
            lambda d, s, p: _replace_array(d, s, p, "temperature", np.arange(len(p.seq_ids), dtype="<i4").tobytes(), None),
            RejectCode.BAD_SAMPLING,
        ),
        WireCase("version_old", lambda d, s, p: [_parts(d, s, p, version=PROTOCOL_VERSION - 1)], RejectCode.BAD_VERSION),
        WireCase("version_next", lambda d, s, p: [_parts(d, s, p, version=PROTOCOL_VERSION + 1)], RejectCode.BAD_VERSION),
        WireCase("version_negative", lambda d, s, p: [_parts(d, s, p, version=-1)], RejectCode.BAD_VERSION),
        WireCase("version_huge", lambda d, s, p: [_parts(d, s, p, version=2**63 - 1)], RejectCode.BAD_VERSION),
        WireCase("layout_zero", lambda d, s, p: [_parts(d, s, p, layout=0)], RejectCode.BAD_LAYOUT),
        WireCase("layout_next", lambda d, s, p: [_parts(d, s, p, layout=2)], RejectCode.BAD_LAYOUT),
        WireCase("run_id_other", lambda d, s, p: [_parts(d, s, p, run_id="another-launch")], RejectCode.BAD_RUN_ID),
        WireCase("run_id_empty", lambda d, s, p: [_parts(d, s, p, run_id="")], RejectCode.BAD_RUN_ID),
        WireCase("step_next", lambda d, s, p: [d.stamp(p, s + 1)], RejectCode.BAD_STEP, lambda s: s + 1),
        WireCase("step_far", lambda d, s, p: [d.stamp(p, s + 10_000)], RejectCode.BAD_STEP, lambda s: s + 10_000),
        WireCase("step_previous", lambda d, s, p: [d.stamp(p, s - 1)], RejectCode.BAD_STEP, lambda s: s - 1),
        WireCase("step_zero", lambda d, s, p: [d.stamp(p, 0)], RejectCode.BAD_STEP, lambda s: 0),
        WireCase("step_negative", lambda d, s, p: [d.stamp(p, -5)], RejectCode.BAD_STEP, lambda s: -5),
        WireCase("step_int64_max", lambda d, s, p: [d.stamp(p, 2**63 - 1)], RejectCode.BAD_STEP, lambda s: 2**63 - 1),
        WireCase("seq_replayed", _replayed, RejectCode.REPLAY),
        WireCase("seq_older_than_the_last", _older_seq, RejectCode.REPLAY),
        WireCase("seq_zero", lambda d, s, p: [_parts(d, s, p, seq=0)], RejectCode.REPLAY),
        WireCase("seq_negative", lambda d, s, p: [_parts(d, s, p, seq=-(2**63))], RejectCode.REPLAY),
        WireCase("go_with_nothing_staged", _other_body(Go()), RejectCode.UNEXPECTED_FRAME),
        WireCase("ready_from_the_scheduler", _other_body(Ready(0)), RejectCode.UNEXPECTED_FRAME),
        WireCase("done_from_the_scheduler", _other_body(Done(1)), RejectCode.UNEXPECTED_FRAME),
        WireCase("reject_from_the_scheduler", _other_body(Reject(0, 1, "no")), RejectCode.UNEXPECTED_FRAME),
        WireCase(
            "result_from_the_scheduler",
            _other_body(Result(np.arange(2), np.zeros(2, np.int32), np.zeros(2, np.float32), np.ones(2, np.uint8))),
            RejectCode.UNEXPECTED_FRAME,
        ),
        WireCase("hello_after_welcome", _other_body(Hello(0, 1, (3,), 1, "fp", g)), RejectCode.UNEXPECTED_FRAME),
        WireCase("welcome_again", _other_body(Welcome(3, 1, 1, g)), RejectCode.UNEXPECTED_FRAME),
        WireCase("heartbeat_from_a_stranger_rank", _other_body(Heartbeat(12345)), None),
    ]  # fmt: skip
    if big:
        cases += [
            WireCase("frame_over_64mib", lambda d, s, p: [[_parts(d, s, p)[0], bytes(64 << 20), bytes(32)]], RejectCode.TOO_LARGE),
            WireCase("array_of_8m_tokens", lambda d, s, p: [d.stamp(dataclasses.replace(p, token_ids=np.zeros(8 << 20, np.int32)), s)], RejectCode.LENGTH_MISMATCH),
        ]  # fmt: skip
    return cases


def check_wire_outcome(case: WireCase, sent: Sent, world_size: int) -> list[str]:
    """What is wrong with the ranks' answers to a wire case (nothing: an empty list)."""
    if not case.answered:
        stray = {rank: answers for rank, answers in sent.answers.items() if answers}
        return [f"answered a frame the protocol ignores: {stray}"] if stray else []
    problems = _one_answer_each(sent, world_size)
    if problems:
        return problems
    step = case.answer_step(sent.step)
    for rank, answers in sorted(sent.answers.items()):
        a = answers[0]
        if (a.kind, a.code, a.step) != ("REJECT", case.expect, step):
            problems.append(
                f"rank {rank} answered {a.kind} {a.code.name if a.code else ''} for step {a.step} ({a.message[:160]}); "
                f"expected REJECT {case.expect.name} for step {step}"
            )
    return problems


def _one_answer_each(sent: Sent, world_size: int) -> list[str]:
    problems = []
    for rank in range(world_size):
        answers = sent.answers.get(rank, [])
        if len(answers) != 1:
            problems.append(f"rank {rank} sent {len(answers)} answers: {answers}")
    return problems


# -- the good step ------------------------------------------------------------------------------


def good_prepare(g: CacheGeometry) -> Prepare:
    """Two greedy sequences, a prefill of three tokens and one of a single token, on pages that the
    frame clears: whatever the frames before it left in the cache or in the held page tables, a
    sound rank computes the same thing from it."""
    pages = (0, 1) if g.num_kv_pages > 1 else (0, 0)
    return Prepare.greedy(
        query_lens=np.array([3, 1]),
        context_lens=np.array([3, 1]),
        token_ids=np.array([3, 4, 5, 7]) % g.vocab_size,
        page_table_lens=np.array([1, 1]),
        page_table=np.array(pages),
        seq_ids=np.array([1, 2]),
        cleared_pages=np.array(sorted(set(pages))),
    )


def check_good_step(outcome: StepDone | StepRefused, expected: Sequence[int] | None) -> tuple[list[int], list[str]]:
    """The tokens of a good step, and what is wrong with them (a refusal, a non-finite row, other
    tokens than `expected`)."""
    if isinstance(outcome, StepRefused):
        return [], [f"the good step was refused: {outcome.message}"]
    tokens = outcome.result.token_ids.tolist()
    problems = []
    if outcome.result.finite.tolist() != [1] * len(tokens):
        problems.append(f"the good step had non-finite rows: {outcome.result.finite.tolist()}")
    if expected is not None and tokens != list(expected):
        problems.append(f"the good step gave {tokens}, before the fuzzing {list(expected)}")
    return tokens, problems
