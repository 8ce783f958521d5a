"""Stop strings over streamed text: the output is the text cut before the first stop string,
however the text is split into deltas, and no part of a stop string is sent early."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tp_runtime.http.generation import StopStringMatcher

ALPHABET = "ab\n é"


def run(stops: tuple[str, ...], deltas: list[str]) -> tuple[list[str], bool]:
    matcher = StopStringMatcher(stops)
    sent = []
    for delta in deltas:
        out, stopped = matcher.feed(delta)
        sent.append(out)
        if stopped:
            return sent, True
    sent.append(matcher.flush())
    return sent, False


def expected(deltas: list[str], stops: tuple[str, ...]) -> tuple[str, bool]:
    """Generation ends with the first delta after which the text holds a stop string, cut where
    the earliest stop in it begins: a stop that would only be complete in later text never is,
    since that text is never generated (vLLM checks after each token alike)."""
    text = ""
    for delta in deltas:
        text += delta
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text(alphabet=ALPHABET, max_size=4), max_size=12),
    st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=3), max_size=3),
)
@example(deltas=[" b", "a"], stops=["b", " ba"])  # " ba" begins earlier but is never complete in time
def test_output_is_text_cut_at_first_stop(deltas, stops):
    stops = tuple(stops)
    sent, stopped = run(stops, deltas)
    assert ("".join(sent), stopped) == expected(deltas, stops)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.text(alphabet=ALPHABET, max_size=4), max_size=12),
    st.text(alphabet=ALPHABET, min_size=2, max_size=3),
)
def test_only_a_possible_stop_prefix_is_held(deltas, stop):
    matcher = StopStringMatcher((stop,))
    total = sent = ""
    for delta in deltas:
        total += delta
        out, stopped = matcher.feed(delta)
        sent += out
        if stopped:
            assert sent == total[: total.find(stop)]
            return
        held = total[len(sent) :]
        assert total.startswith(sent)
        # Held back: exactly the longest tail that could still grow into the stop string.
        longest = max((k for k in range(len(stop)) if total.endswith(stop[:k])), default=0)
        assert len(held) == longest


def test_split_stop_string_is_held_then_released():
    matcher = StopStringMatcher(("END",))
    assert matcher.feed("abc E") == ("abc ", False)
    assert matcher.feed("N") == ("", False)
    assert matcher.feed("x") == ("ENx", False)
    assert matcher.feed(" EN") == (" ", False)
    assert matcher.feed("D tail") == ("", True)


def test_no_stops_passes_text_through():
    matcher = StopStringMatcher(())
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.flush() == ""
