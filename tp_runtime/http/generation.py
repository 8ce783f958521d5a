"""One admitted request's output as the client sees it: text pieces cut at stop strings, with the
tokens and log-probabilities behind each piece.

A `Generation` reads the engine's `RequestOutput`s, detokenizes them into whole characters, holds back
any tail that could start a stop string, and makes sure the engine hears of a request nobody reads
any more. It knows nothing of HTTP beyond the ApiError a failure carries.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from protocol.errors import TPRuntimeError
from tp_runtime.engine import EngineUnavailable, RequestStream
from tp_runtime.http.api_models import Usage
from tp_runtime.http.errors import ApiError, unavailable
from tp_runtime.recovery import Fault
from tp_runtime.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from tp_runtime.engine import Engine

# JSON has no -inf; OpenAI and vLLM report a log-probability that underflowed as this.
LOGPROB_FLOOR = -9999.0


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back any tail that could start one, so that no
    part of a stop string is ever sent before it is known to be one."""

    def __init__(self, stops: tuple[str, ...]):
        self._stops = stops
        self._text = ""
        self._sent = 0
        self.stop_end = 0  # once a stop string ended the output: where it ends in the text fed

    def feed(self, delta: str, match: bool = True) -> tuple[str, bool]:
        """(text that is safe to send, whether a stop string ended the output). match=False: the
        text cannot end the output (before min_tokens) and goes out whole, never to be matched."""
        self._text += delta
        if not self._stops or not match:
            out, self._sent = self._text[self._sent :], len(self._text)
            return out, False
        # Everything before _sent was checked not to start a stop string, so a match starts later.
        hits = [i for i in (self._text.find(s, self._sent) for s in self._stops) if i >= 0]
        if hits:
            end = min(hits)
            self.stop_end = min(end + len(s) for s in self._stops if self._text.startswith(s, end))
            out, self._sent = self._text[self._sent : end], end
            return out, True
        safe = len(self._text) - self._open_prefix_length()
        out, self._sent = self._text[self._sent : max(safe, self._sent)], max(safe, self._sent)
        return out, False

    def flush(self) -> str:
        """The held-back tail, once the output has ended without completing a stop string."""
        out, self._sent = self._text[self._sent :], len(self._text)
        return out

    def _open_prefix_length(self) -> int:
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self._text) - self._sent), longest, -1):
                if self._text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


@dataclass(frozen=True)
class SampledToken:
    """One generated token: its id, its log-probability, and where its text starts in the output.
    `top` holds the alternatives the executor returned with it, most likely first (as many as the
    request asked for)."""

    token_id: int
    logprob: float
    text_offset: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Piece:
    """One step of a request's output as the client sees it."""

    text: str
    finish_reason: str | None  # set on the last piece: "length" or "stop"
    token_ids: tuple[int, ...]  # generated since the previous piece
    # The same tokens with their log-probabilities and text offsets: only for a generation that
    # tracks them (Generation's `tracked`), else empty.
    tokens: tuple[SampledToken, ...] = ()


class GenerationFailed(TPRuntimeError):
    """The runtime failed the request after admission; carries the HTTP-shaped error."""

    def __init__(self, error: ApiError, fault: str = Fault.OTHER):
        super().__init__(error.message)
        self.error = error
        self.fault = fault  # the label of tp_runtime_request_errors_total (tp_runtime.recovery.Fault)


class RequestObserver(Protocol):
    """Timing of one request as the HTTP side sees it (tp_runtime.http.metrics implements it)."""

    def tokens(self, count: int, now: float) -> None: ...

    def ended(self, reason: str, prompt_tokens: int, completion_tokens: int, now: float) -> None: ...


class Generation:
    """One admitted request: its token events become text pieces."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        stream: RequestStream,
        prompt_token_ids: list[int],
        stops: tuple[str, ...],
        observer: RequestObserver | None = None,
        min_tokens: int = 0,
        logprobs: bool = False,
        index: int = 0,
    ):
        """logprobs: the answer lists each token's log-probability and text offset. index: the
        request's choice this generation is (of n)."""
        self.request_id = stream.request_id
        self.index = index
        self.prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = []
        self._engine = engine
        self._stream = stream
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = StopStringMatcher(stops)
        self._observer = observer
        # As vLLM: no stop string ends the output before min_tokens tokens were generated.
        self._min_tokens = min_tokens
        self._decoded_chars = 0  # tracked: detokenized text so far, before stop strings cut it
        # Each token's text offset needs its own detokenizer step: only logprobs, and stop strings
        # (which drop the tokens after their end), ask for it. Otherwise a step's tokens are
        # detokenized at once and no object is made per token: bench_http's HTTP thread made 16
        # Python calls a token where it made 31 (docs/control_plane.md).
        self.tracked = logprobs or bool(stops)
        self._pending: list[SampledToken] = []  # tracked tokens not yet handed out with a piece
        self._handed = 0  # token_ids[:_handed] went out with pieces

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )

    async def pieces(self) -> AsyncIterator[tuple[int, Piece]]:
        """(choice index, piece) as each piece comes: the index rides with it, so that one
        generation's pieces are pieces_of's own without a generator between (one a piece)."""
        ended = False
        try:
            async for event in self._stream:
                if event.token_ids and self._observer is not None:
                    self._observer.tokens(len(event.token_ids), time.monotonic())
                if event.finish_reason == "error" or event.error is not None:
                    ended = True
                    self._end("error")
                    raise GenerationFailed(self._failure(event.error), event.fault or Fault.OTHER)
                text = self._add(event.token_ids, event.logprobs, event.top_logprobs)
                if event.finished:
                    text += self._detokenizer.flush()
                out, stopped = self._stops.feed(text, len(self.token_ids) >= self._min_tokens)
                if stopped:
                    self._drop_tokens_after(self._stops.stop_end)
                    ended = True
                    self._engine.finish(self.request_id)
                    self._end("stop")
                    yield self.index, self._piece(out, "stop")
                    return
                if event.finished:
                    ended = True
                    if event.finish_reason not in ("length", "stop"):
                        self._end("abort")
                        raise GenerationFailed(
                            unavailable(f"the runtime ended the request early ({event.finish_reason})")
                        )
                    self._end(event.finish_reason)
                    yield self.index, self._piece(out + self._stops.flush(), event.finish_reason)
                    return
                if out:
                    yield self.index, self._piece(out, None)
            ended = True
            self._end("error")
            raise GenerationFailed(self._failure("the token stream ended without a final event"))
        except EngineUnavailable as exc:
            ended = True
            self._end("error")
            raise GenerationFailed(unavailable(str(exc), exc.retry_after_s), Fault.RUNTIME_DOWN) from exc
        finally:
            if not ended:
                # The reader went away (client disconnect, cancelled task): free the slot now.
                self._engine.cancel(self.request_id)
                self._end("abort")

    def _add(
        self, token_ids: tuple[int, ...], logprobs: tuple[float, ...], tops: tuple[tuple[tuple[int, float], ...], ...]
    ) -> str:
        self.token_ids.extend(token_ids)
        if not self.tracked:
            return self._detokenizer.extend(token_ids)
        parts = []
        for i, (token, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
            top = tuple((t, max(lp, LOGPROB_FLOOR)) for t, lp in tops[i]) if tops else ()
            self._pending.append(SampledToken(token, max(logprob, LOGPROB_FLOOR), self._decoded_chars, top))
            delta = self._detokenizer.add(token)
            self._decoded_chars += len(delta)
            parts.append(delta)
        return "".join(parts)

    def _drop_tokens_after(self, end: int) -> None:
        """The output ended at text offset `end` (a stop string's end): an event of several tokens
        (a step of several forwards) may hold some whose text starts after it. They are not the
        output's, as one token per event would never have sampled them: usage and logprobs leave
        them out."""
        keep = len(self._pending)
        while keep and self._pending[keep - 1].text_offset >= end:
            keep -= 1
        dropped = len(self._pending) - keep
        if dropped:
            del self._pending[keep:]
            del self.token_ids[-dropped:]

    def abandon(self) -> None:
        """A request submitted but never read (a sibling of n could not be submitted): end it now."""
        self._engine.cancel(self.request_id)
        self._end("abort")

    def _piece(self, text: str, finish_reason: str | None) -> Piece:
        ids, self._handed = tuple(self.token_ids[self._handed :]), len(self.token_ids)
        tokens, self._pending = tuple(self._pending), []
        return Piece(text, finish_reason, ids, tokens)

    def _end(self, reason: str) -> None:
        if self._observer is not None:
            self._observer.ended(reason, self.prompt_tokens, self.completion_tokens, time.monotonic())
            self._observer = None

    def _failure(self, message: str | None) -> ApiError:
        text = message or "the runtime failed this request"
        if not self._engine.health().ok:
            return unavailable(text, self._engine.retry_after_s())
        return ApiError(500, text, type="server_error", code="generation_failed")
