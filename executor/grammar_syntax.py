"""What llguidance makes of a request's grammar (protocol/grammar.py), without torch: the executor's
grammar engine builds its matchers from it, and the frontend, which imports no torch, checks a
grammar with it before it admits the request."""

from __future__ import annotations

from protocol.grammar import GrammarKind, GrammarSpec


# JSON is written with fixed separators (", " and ": ") and no other whitespace, as vLLM's
# --structured-outputs-config.disable_any_whitespace writes it: with whitespace free, a small model
# can spend its whole budget on newlines inside an object that never closes.
JSON_OPTIONS = {"whitespace_flexible": False}


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec (what LLMatcher takes); ValueError if it is not JSON where
    JSON is due."""
    import llguidance

    matcher = llguidance.LLMatcher
    if spec.kind == GrammarKind.JSON_SCHEMA:
        return matcher.grammar_from_json_schema(spec.text, overrides=JSON_OPTIONS)
    if spec.kind == GrammarKind.JSON_OBJECT:
        return matcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
    if spec.kind == GrammarKind.REGEX:
        return matcher.grammar_from_regex(spec.text)
    if spec.kind == GrammarKind.CHOICE:
        return llguidance.grammar_from("choice", spec.text)
    return llguidance.grammar_from("grammar", spec.text)


def grammar_problem(spec: GrammarSpec) -> str | None:
    """Why the engine would refuse `spec`, or None (no tokenizer is needed to know)."""
    import llguidance

    try:
        grammar = llguidance_grammar(spec)
    except ValueError as exc:
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(grammar) or None
