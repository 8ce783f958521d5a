"""The rules a sequence's own fields (sampling parameters, feedback, token ids) can break: checked last,
on an otherwise sound PREPARE, and named per sequence (ProtocolError.seq_ids) so that only their
requests fail."""

from __future__ import annotations

import numpy as np

from protocol.errors import ProtocolError, RejectCode
from protocol.frames import CacheGeometry, Prepare
from protocol.grammar import GrammarKind
from protocol.sampling_limits import (
    FLOAT32_MAX,
    LOGIT_BIAS_MAX,
    LOGIT_BIAS_MIN,
    PENALTY_MAX,
    PENALTY_MIN,
    REPETITION_PENALTY_MIN,
    TEMPERATURE_MIN,
    TOP_LOGPROBS_MAX,
    TOP_P_MIN,
)
from protocol.validate.array_checks import all_in_range

# (the code a failure carries, the field, what a valid value is, which sequences broke it)
Rule = tuple[RejectCode, str, str, np.ndarray]

# The per-sequence float fields and their bounds in float32, the fields' dtype, as the rules compare
# them. Temperature's low bound here is 0: the gap (0, TEMPERATURE_MIN) is looked at apart.
_FLOATS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
_FLOAT_LOW = np.array([0, TOP_P_MIN, PENALTY_MIN, PENALTY_MIN, REPETITION_PENALTY_MIN, 0], dtype=np.float32)
_FLOAT_HIGH = np.array([FLOAT32_MAX, 1, PENALTY_MAX, PENALTY_MAX, FLOAT32_MAX, 1], dtype=np.float32)
# What a sequence that uses no penalty holds in presence, frequency and repetition (_FLOATS[2:5]).
_UNPENALIZED = np.array([0, 0, 1], dtype=np.float32)
_CARRIED = ("history_lens", "logit_bias_lens", "grammar_lens")


def check_own_fields(p: Prepare, g: CacheGeometry) -> None:
    """The rules one sequence's own fields can break; the error names every sequence that broke
    any of them. NaN fails every comparison, so each rule is written as "not (the valid range)".
    A step whose fields are plainly valid is passed with a dozen reductions; any other is judged
    rule by rule."""
    if not plainly_valid(p, g):
        check_each_rule(p, g)


def check_each_rule(p: Prepare, g: CacheGeometry) -> None:
    """check_own_fields without the shortcut: every rule's mask over the sequences."""
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
    rules += _processing_rules(p, g)
    for name, counts in (
        ("token_ids", p.query_lens),
        ("history", p.history_lens),
        ("logit_bias_ids", p.logit_bias_lens),
        ("banned_ids", p.banned_lens),
    ):
        tokens = getattr(p, name)
        if not all_in_range(tokens, g.vocab_size):
            rules.append((
                RejectCode.TOKEN_OUT_OF_RANGE,
                name,
                f"every {'new token' if name == 'token_ids' else 'token id'} in [0, {g.vocab_size})",
                _owners(counts, (tokens < 0) | (tokens >= g.vocab_size)),
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


def plainly_valid(p: Prepare, g: CacheGeometry) -> bool:
    """True only when no rule of check_own_fields can fire, decided from each field's least and
    greatest values: every per-sequence rule costs a handful of numpy calls on tiny arrays, a fixed
    cost per step that a server's decode steps pay on every rank. False sends the step to the
    rules, which also find what is wrong; so a case this does not settle may answer False.
    NaN makes a min or max NaN, which fails every bound."""
    if not p.seq_ids.shape[0]:
        return False
    floats = np.vstack([getattr(p, name) for name in _FLOATS])
    low, high = floats.min(axis=1), floats.max(axis=1)
    if not ((low >= _FLOAT_LOW).all() and (high <= _FLOAT_HIGH).all()):
        return False
    temperature = p.temperature
    if low[0] < TEMPERATURE_MIN and ((temperature > 0) & (temperature < TEMPERATURE_MIN)).any():
        return False
    if p.top_k.min() < 0 or p.seeds.min() < -1:
        return False
    feedback_max, logprobs_max, state_max = np.vstack((p.feedback, p.num_logprobs, p.sampling_state)).max(axis=1)
    if feedback_max > 1 or logprobs_max > min(TOP_LOGPROBS_MAX, g.vocab_size) or state_max > 2:
        return False
    if feedback_max and (p.query_lens != 1).any():
        return False
    # A penalized sequence must hold state 1 or 2; one that carries a history, a bias or a grammar,
    # state 1; with neither in the step, only the bound above applies.
    penalized = not ((low[2:5] == _UNPENALIZED).all() and (high[2:5] == _UNPENALIZED).all())
    if penalized or np.vstack([getattr(p, name) for name in _CARRIED]).any():
        return False
    return all_in_range(p.token_ids, g.vocab_size) and all_in_range(p.banned_ids, g.vocab_size)


def _owners(counts: np.ndarray, flat_mask: np.ndarray) -> np.ndarray:
    """Per sequence: whether any of its entries of a flat array (counts[i] of them, in order) is
    set in flat_mask."""
    owner = np.arange(counts.shape[0]).repeat(counts)
    return np.bincount(owner[flat_mask], minlength=counts.shape[0]) > 0


def _processing_rules(p: Prepare, g: CacheGeometry) -> list[Rule]:
    """The logits-processing fields' rules (protocol/sampling_limits.py), as masks over sequences."""
    presence, frequency, repetition = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
    state = p.sampling_state
    penalized = (presence != 0) | (frequency != 0) | (repetition != 1)
    sent_here = (p.history_lens != 0) | (p.logit_bias_lens != 0) | (p.grammar_lens != 0)
    min_p = p.min_p
    rules = [
        (
            RejectCode.BAD_SAMPLING,
            "num_logprobs",
            f"at most {min(TOP_LOGPROBS_MAX, g.vocab_size)}",
            p.num_logprobs > min(TOP_LOGPROBS_MAX, g.vocab_size),
        ),
        (
            RejectCode.BAD_SAMPLING,
            "presence_penalty",
            f"in [{PENALTY_MIN:g}, {PENALTY_MAX:g}]",
            ~((presence >= PENALTY_MIN) & (presence <= PENALTY_MAX)),
        ),
        (
            RejectCode.BAD_SAMPLING,
            "frequency_penalty",
            f"in [{PENALTY_MIN:g}, {PENALTY_MAX:g}]",
            ~((frequency >= PENALTY_MIN) & (frequency <= PENALTY_MAX)),
        ),
        (
            RejectCode.BAD_SAMPLING,
            "repetition_penalty",
            f"in [{REPETITION_PENALTY_MIN}, {FLOAT32_MAX:.7g}] (1: off)",
            ~((repetition >= REPETITION_PENALTY_MIN) & (repetition <= FLOAT32_MAX)),
        ),
        (
            RejectCode.BAD_SAMPLING,
            "sampling_state",
            "0 (none), 1 (sent here) or 2 (held); 1 or 2 with a penalty; 1 to carry a history, a logit bias or a "
            "grammar",
            (state > 2) | (penalized & (state == 0)) | (sent_here & (state != 1)),
        ),
        (RejectCode.BAD_SAMPLING, "min_p", "in [0, 1] (0: off)", ~((min_p >= 0) & (min_p <= 1))),
    ]
    return rules + _logit_bias_rules(p) + _grammar_rules(p)


def _logit_bias_rules(p: Prepare) -> list[Rule]:
    """The rules on the flat logit-bias arrays, as masks over sequences (none when no sequence
    carries a bias in this step)."""
    bias, ids, counts = p.logit_bias, p.logit_bias_ids, p.logit_bias_lens
    if not bias.shape[0]:
        return []
    # Within a sequence each id follows a smaller one: the first entry of each sequence is
    # exempt, being compared with the previous sequence's last.
    starts = np.zeros(ids.shape[0], dtype=bool)
    starts[(counts.cumsum(dtype=np.int64) - counts)[counts > 0]] = True
    repeated = np.zeros(ids.shape[0], dtype=bool)
    repeated[1:] = ids[1:] <= ids[:-1]
    return [
        (
            RejectCode.BAD_SAMPLING,
            "logit_bias",
            f"in [{LOGIT_BIAS_MIN:g}, {LOGIT_BIAS_MAX:g}]",
            _owners(counts, ~((bias >= LOGIT_BIAS_MIN) & (bias <= LOGIT_BIAS_MAX))),
        ),
        (
            RejectCode.BAD_SAMPLING,
            "logit_bias_ids",
            "strictly increasing within a sequence",
            _owners(counts, repeated & ~starts),
        ),
    ]


def _grammar_rules(p: Prepare) -> list[Rule]:
    """Each grammar starts with a kind byte that protocol.grammar knows."""
    counts = p.grammar_lens
    if not p.grammar.shape[0]:
        return []
    starts = (counts.cumsum(dtype=np.int64) - counts)[counts > 0]
    kinds = p.grammar[starts]
    known = np.isin(kinds, [int(k) for k in GrammarKind])
    bad = np.zeros(counts.shape[0], dtype=bool)
    bad[(counts > 0).nonzero()[0][~known]] = True
    return [(RejectCode.BAD_SAMPLING, "grammar", f"one of the kinds {[int(k) for k in GrammarKind]}", bad)]


def _describe(p: Prepare, g: CacheGeometry, name: str, i: int) -> str:
    who = f"sequence {int(p.seq_ids[i])} (index {i})"
    counts_of = {
        "token_ids": p.query_lens, "history": p.history_lens, "logit_bias_ids": p.logit_bias_lens,
        "logit_bias": p.logit_bias_lens, "banned_ids": p.banned_lens, "grammar": p.grammar_lens,
    }
    counts = counts_of.get(name)
    if counts is None:
        return f"{who} has {getattr(p, name)[i]!r}"
    start = int(counts[:i].sum(dtype=np.int64))
    own = getattr(p, name)[start : start + int(counts[i])]
    if name == "grammar":
        return f"{who} has kind {own[0].item()!r}"
    if name == "logit_bias":
        bad = own[~((own >= LOGIT_BIAS_MIN) & (own <= LOGIT_BIAS_MAX))]
    elif name == "logit_bias_ids" and not ((own < 0) | (own >= g.vocab_size)).any():
        bad = own[1:][own[1:] <= own[:-1]]
    else:
        bad = own[(own < 0) | (own >= g.vocab_size)]
    return f"{who} has {bad[0].item()!r}"
