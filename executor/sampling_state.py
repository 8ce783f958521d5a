"""The sampling state rank 0 holds between steps, and each step's logits processing built from it.

A sequence with a penalty or a logit bias has a state: its logit bias, and the tokens the penalties
count (the prompt's for the repetition penalty, the output's for all three). The scheduler sends it
whole once (PREPARE.sampling_state 1) when the sequence first appears, after a preemption or after
an ABORT, exactly when it sends the page table whole, so that a prompt found in the prefix cache,
whose tokens never travel as step tokens, is still counted. From then on (sampling_state 2) rank 0
extends the output with every token it samples for it. The rules are the page tables' rules
(protocol/page_tables.py): a sequence absent from a step is forgotten, and the link refuses
sampling_state 2 for a sequence the last PREPARE did not carry (SAMPLING_STATE_NOT_HELD), ABORT
included, so what this class is asked for is always here.

It lives on the model's thread and changes only as steps run, in step order: with the scheduler
planning ahead, step N+1 is staged while step N runs, and N+1 must see N's samples. The history
sent whole with a feedback row was planned before that row's fed-back token was known, so the fed
token is appended when the step runs.

A sequence with an output grammar holds a matcher (executor/grammar.py) in its state, built from the
grammar and the output sent whole with it, off this thread (`prefetch` as the step starts, taken in
`begin`), then advanced by every token appended, the fed one included. Its row's mask is filled
when the row is sampled, after the token of the step before was appended: a step planned ahead
never samples with a mask one token stale.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor.host_copy import to_device
from executor.grammar import GrammarEngine, GrammarMatcher, forbidden_tokens, new_bitmask
from executor.sampler import LogitsProcessing
from protocol.errors import ProtocolError, RejectCode
from protocol.frames import Prepare

_NO_IDS = np.zeros(0, dtype=np.int64)
_NO_VALUES = np.zeros(0, dtype=np.float32)


class StatefulSequences:
    """The link's side of the rule, on every rank: which sequences' states rank 0 holds when the
    next PREPARE runs (those the last accepted PREPARE carried or kept, sorted)."""

    def __init__(self) -> None:
        self.drop()

    def drop(self) -> None:
        """At an ABORT: the scheduler sends every state whole next."""
        self._ids = _NO_IDS

    def accept(self, p: Prepare) -> None:
        """p's sampling_state 2 only for sequences held; they and the ones p sends become the held."""
        states = p.sampling_state
        if not self._ids.shape[0] and not states.any():
            return
        kept = p.seq_ids[states == 2]
        held = self._ids
        if held.shape[0]:
            at = np.minimum(held.searchsorted(kept), held.shape[0] - 1)
            missing = kept[held[at] != kept]
        else:
            missing = kept
        if missing.shape[0]:
            raise ProtocolError(
                RejectCode.SAMPLING_STATE_NOT_HELD,
                f"sampling_state 2 for sequences {missing.tolist()[:8]} whose sampling state this executor does "
                "not hold (the PREPARE before did not carry it, or an ABORT dropped it)",
            )
        self._ids = np.sort(p.seq_ids[states != 0])


@dataclass
class _State:
    prompt: np.ndarray  # int64: the prompt's tokens (empty unless the repetition penalty is on)
    buffer: np.ndarray  # int64: the output so far in its first `length` entries, room after them
    length: int
    bias_ids: np.ndarray  # int64, ascending
    bias_values: np.ndarray  # float32
    matcher: GrammarMatcher | None = None  # its output grammar's state, past the output so far

    @classmethod
    def create(
        cls, prompt: np.ndarray, output: np.ndarray, bias_ids: np.ndarray, bias_values: np.ndarray,
        matcher: GrammarMatcher | None = None,
    ) -> _State:
        buffer = np.empty(max(16, 2 * output.shape[0]), dtype=np.int64)
        buffer[: output.shape[0]] = output
        return cls(prompt, buffer, output.shape[0], bias_ids, bias_values, matcher)

    @property
    def output(self) -> np.ndarray:
        return self.buffer[: self.length]

    def append(self, token: int) -> None:
        if self.length == self.buffer.shape[0]:
            self.buffer = np.concatenate((self.buffer, np.empty_like(self.buffer)))  # doubled: amortized O(1)
        self.buffer[self.length] = token
        self.length += 1
        if self.matcher is not None:
            self.matcher.consume(token)


def touches_states(p: Prepare) -> bool:
    """Whether step p has work for rank 0's sampling states or logits processing: a row that sends
    or keeps a sampling state, bans tokens or sets min_p. Asked where the step is staged (the link's
    thread): between two forwards its reads took ~15 us (docs/control_plane.md, change 88)."""
    return bool(p.sampling_state.any() or p.banned_lens.any() or p.min_p.any())


class SamplingStates:
    """grammars: rank 0's grammar engine; None where no grammar can come (the executors of tests
    that build steps by hand), and a grammar that comes anyway is a wiring error."""

    def __init__(self, grammars: GrammarEngine | None = None) -> None:
        self._held: dict[int, _State] = {}
        self._grammars = grammars

    def __len__(self) -> int:
        return len(self._held)

    def output_of(self, seq_id: int) -> list[int]:
        """The output tokens held for a sequence (tests and debugging)."""
        return self._held[seq_id].output.tolist()

    def _grammar_engine(self) -> GrammarEngine:
        if self._grammars is None:
            raise RuntimeError("a PREPARE carries a grammar, and this executor was started without a grammar engine")
        return self._grammars

    def prefetch(self, p: Prepare) -> None:
        """As step p starts: build the matchers of the grammars it sends, off this thread, while
        its forward runs."""
        lens = p.grammar_lens
        if not p.grammar.shape[0]:
            return
        engine = self._grammar_engine()
        grammar_ends = lens.cumsum(dtype=np.int64)
        history_ends = p.history_lens.cumsum(dtype=np.int64)
        for i in lens.nonzero()[0].tolist():
            output = p.history[history_ends[i] - p.history_lens[i] + p.history_prompt_lens[i] : history_ends[i]]
            engine.prefetch(int(p.seq_ids[i]), p.grammar[grammar_ends[i] - lens[i] : grammar_ends[i]], output)

    def begin(self, p: Prepare, fed: dict[int, int]) -> None:
        """Step p starts: keep the states of its sequences (the others are forgotten) and take the
        ones it sends whole. fed: the token a feedback row of p receives, by sequence index (only
        those of rows sent whole are read)."""
        states = p.sampling_state
        if not self._held and not states.any():
            return
        held, new = self._held, {}
        history_ends = p.history_lens.cumsum(dtype=np.int64)
        bias_ends = p.logit_bias_lens.cumsum(dtype=np.int64)
        grammar_ends = p.grammar_lens.cumsum(dtype=np.int64)
        for i in states.nonzero()[0].tolist():
            seq_id = int(p.seq_ids[i])
            if states[i] == 2:
                new[seq_id] = held[seq_id]
                continue
            h1 = int(history_ends[i])
            h0 = h1 - int(p.history_lens[i])
            split = h0 + int(p.history_prompt_lens[i])
            b1 = int(bias_ends[i])
            b0 = b1 - int(p.logit_bias_lens[i])
            matcher = None
            if p.grammar_lens[i]:
                g1 = int(grammar_ends[i])
                matcher = self._grammar_engine().take(seq_id, p.grammar[g1 - int(p.grammar_lens[i]) : g1], p.history[split:h1])
            state = _State.create(
                prompt=p.history[h0:split].astype(np.int64),
                output=p.history[split:h1],
                bias_ids=p.logit_bias_ids[b0:b1].astype(np.int64),
                bias_values=p.logit_bias[b0:b1].astype(np.float32),
                matcher=matcher,
            )
            if p.feedback[i]:
                state.append(fed[i])
            new[seq_id] = state
        self._held = new

    def forget(self) -> None:
        """A step that touches no state (touches_states) starts: as begin() would, every state held
        is forgotten (the step keeps none)."""
        if self._held:
            self._held = {}

    def append(self, seq_ids: np.ndarray, tokens: np.ndarray, finite: np.ndarray) -> None:
        """The tokens just sampled (finite rows only: the others fail their requests)."""
        if not self._held:
            return
        held = self._held
        for seq_id, token, ok in zip(seq_ids.tolist(), tokens.tolist(), finite.tolist()):
            state = held.get(seq_id)
            if state is not None and ok:
                state.append(token)

    def processing(self, p: Prepare, device: torch.device | str) -> LogitsProcessing | None:
        """The logits processing of p's sampled rows (row j: the j-th sequence with sample set), or
        None when none of them asks for any."""
        banned_lens = p.banned_lens
        if not self._held and not banned_lens.any() and not p.min_p.any():
            return None
        sampled = p.sample.nonzero()[0]
        row_of = np.full(p.seq_ids.shape[0], -1, dtype=np.int64)
        row_of[sampled] = np.arange(sampled.shape[0])

        banned_owner = np.arange(banned_lens.shape[0]).repeat(banned_lens)
        banned_rows = row_of[banned_owner]
        keep = banned_rows >= 0
        banned_rows, banned_ids = banned_rows[keep], p.banned_ids[keep].astype(np.int64)

        bias_rows, bias_ids, bias_values = [], [], []
        penalty_seqs, prompt_rows, prompt_ids, output_rows, output_ids = [], [], [], [], []
        grammar_rows, matchers = [], []
        penalized = (p.presence_penalty != 0) | (p.frequency_penalty != 0) | (p.repetition_penalty != 1)
        for i in sampled[p.sampling_state[sampled] != 0].tolist():
            state = self._held[int(p.seq_ids[i])]
            row = int(row_of[i])
            if state.matcher is not None:
                grammar_rows.append(row)
                matchers.append(state.matcher)
            if state.bias_ids.shape[0]:
                bias_rows.append(np.full(state.bias_ids.shape[0], row, dtype=np.int64))
                bias_ids.append(state.bias_ids)
                bias_values.append(state.bias_values)
            if penalized[i]:
                k = len(penalty_seqs)
                penalty_seqs.append(i)
                if p.repetition_penalty[i] != 1 and state.prompt.shape[0]:
                    prompt_rows.append(np.full(state.prompt.shape[0], k, dtype=np.int64))
                    prompt_ids.append(state.prompt)
                if state.length:
                    output_rows.append(np.full(state.length, k, dtype=np.int64))
                    output_ids.append(state.output)
        min_p = p.min_p[sampled]
        min_p_rows = min_p.nonzero()[0]
        if not (banned_rows.shape[0] or bias_rows or penalty_seqs or matchers or min_p_rows.shape[0]):
            return None
        seqs = np.asarray(penalty_seqs, dtype=np.int64)
        forbidden = None
        if matchers:
            vocab = self._grammar_engine().vocab_size
            bitmask = new_bitmask(len(matchers), vocab)
            for k, matcher in enumerate(matchers):
                matcher.fill(bitmask, k)
            forbidden = forbidden_tokens(bitmask, vocab, device)

        def longs(values: np.ndarray | list[np.ndarray]) -> torch.Tensor:
            return to_device(_cat(values, _NO_IDS).astype(np.int64, copy=False), device)

        def floats(values: np.ndarray | list[np.ndarray]) -> torch.Tensor:
            return to_device(_cat(values, _NO_VALUES).astype(np.float32), device)

        return LogitsProcessing(
            bias_rows=longs(bias_rows),
            bias_ids=longs(bias_ids),
            bias_values=floats(bias_values),
            banned_rows=longs(banned_rows),
            banned_ids=longs(banned_ids),
            penalty_rows=longs(row_of[seqs]),
            presence=floats(p.presence_penalty[seqs]),
            frequency=floats(p.frequency_penalty[seqs]),
            repetition=floats(p.repetition_penalty[seqs]),
            prompt_rows=longs(prompt_rows),
            prompt_ids=longs(prompt_ids),
            output_rows=longs(output_rows),
            output_ids=longs(output_ids),
            grammar_rows=longs(np.asarray(grammar_rows, dtype=np.int64)) if matchers else None,
            forbidden=forbidden,
            min_p_rows=longs(min_p_rows) if min_p_rows.shape[0] else None,
            min_p=floats(min_p[min_p_rows]) if min_p_rows.shape[0] else None,
        )


def _cat(values: np.ndarray | list[np.ndarray], empty: np.ndarray) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values
    return np.concatenate(values) if values else empty
