"""Rank 0's grammar engine: each constrained sequence's matcher, built off the model's thread, and
the token masks the sampler applies.

llguidance does the work (scripts/bench_grammar.py measured it against xgrammar on this CPU: a JSON
schema compiles in about 1 ms against 18 ms, a mask fills in about 25 us against 5 us, both far
below a decode step; it needs no torch and installs alone, so the frontend checks grammars with the
same engine). Its view of the vocabulary is built once, on first use, from the tokenizer the
composition hands over (`GrammarVocabulary`), on the compile thread.

A matcher is made on a thread of its own (`prefetch`, called as a step starts, so it overlaps that
step's forward) from the grammar's bytes and the output the sequence has so far, which it consumes:
that rebuilds the state of a sequence the scheduler sent whole again (after a preemption by
recompute, an ABORT or an executor restart). The model's thread takes it when it samples the row.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from executor.host_copy import to_device
from executor.grammar_syntax import llguidance_grammar
from protocol.grammar import GrammarSpec


@dataclass(frozen=True)
class GrammarVocabulary:
    """What the engine needs of the tokenizer: its tokenizer.json text and the end-of-sequence
    tokens that end a grammar's output."""

    tokenizer_json: str
    eos_token_ids: tuple[int, ...]


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: object):
        self._matcher = matcher

    def consume(self, token: int) -> None:
        # A token the mask allowed is always accepted; one it did not (a row sampled unmasked) puts
        # the matcher in its error state, which fill() reports by allowing nothing.
        self._matcher.consume_token(token)

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Row `row` of an int32 bitmask: bit t set where token t may come next."""
        if self._matcher.is_error():
            bitmask[row] = 0
            return
        view = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GrammarEngine:
    """vocabulary: loads the tokenizer's view, on first use; vocab_size: the model's (its logits'
    width, which may exceed the tokenizer's: the padding tokens are never allowed)."""

    def __init__(self, vocabulary: Callable[[], GrammarVocabulary], vocab_size: int):
        self._vocabulary = vocabulary
        self.vocab_size = vocab_size
        self._tokenizer: object | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future[GrammarMatcher]] = {}

    def _ensure_tokenizer(self) -> object:
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                vocabulary = self._vocabulary()
                self._tokenizer = llguidance.LLTokenizer(
                    vocabulary.tokenizer_json, n_vocab=self.vocab_size, eos_token=list(vocabulary.eos_token_ids)
                )
            return self._tokenizer

    def build(self, grammar: bytes, output: Sequence[int]) -> GrammarMatcher:
        """A matcher for `grammar` that has consumed `output` (on the calling thread)."""
        import llguidance

        spec = GrammarSpec.decode(grammar)
        matcher = GrammarMatcher(llguidance.LLMatcher(self._ensure_tokenizer(), llguidance_grammar(spec)))
        for token in output:
            matcher.consume(int(token))
        return matcher

    def prefetch(self, seq_id: int, grammar: bytes, output: np.ndarray) -> None:
        """Starts building a sequence's matcher off the calling thread; `take` waits for it. The
        model's thread calls both for one step, in order, so a sequence has one pending at most."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._pending[seq_id] = self._pool.submit(self.build, bytes(grammar), output.tolist())

    def take(self, seq_id: int, grammar: bytes, output: np.ndarray) -> GrammarMatcher:
        """The matcher `prefetch` started for the sequence, or one built now if none was."""
        future = self._pending.pop(seq_id, None)
        return future.result() if future is not None else self.build(bytes(grammar), output.tolist())


def forbidden_tokens(bitmask: np.ndarray, vocab: int, device: torch.device | str) -> torch.Tensor:
    """bool[rows, vocab], True where an int32 bitmask [rows, ceil(vocab / 32)] forbids the token
    (its bit is clear): one C pass on the host, then one copy to the device."""
    bits = np.unpackbits(np.invert(bitmask).view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return to_device(np.ascontiguousarray(bits).view(np.bool_), device)


def new_bitmask(rows: int, vocab: int) -> np.ndarray:
    return np.zeros((rows, (vocab + 31) // 32), dtype=np.int32)
