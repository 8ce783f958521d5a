"""A request's output grammar from its body: OpenAI's response_format (json_object, json_schema) and
vLLM's structured_outputs and guided_json / guided_regex / guided_choice / guided_grammar, checked
here with the engine rank 0 runs (executor/grammar_syntax.py: llguidance, torch-free), so that a
grammar the engine would refuse is a 400 naming its field rather than a failed step.

One grammar per request: a body that asks for two (say response_format and guided_regex) is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from executor.grammar_syntax import grammar_problem
from protocol.grammar import GRAMMAR_MAX_BYTES, GrammarKind, GrammarSpec
from tp_runtime.http.api_models import OpenAISampling
from tp_runtime.http.errors import invalid_request


@dataclass(frozen=True)
class Asked:
    """A grammar and the field of the body that asked for it (for error messages)."""

    spec: GrammarSpec
    param: str


def _schema_text(schema: object, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise invalid_request(f"'{param}' must be a JSON schema: {exc}", param=param) from None
    if not isinstance(schema, dict | bool):
        raise invalid_request(f"'{param}' must be a JSON schema (an object)", param=param)
    return json.dumps(schema)


def _asked(body: OpenAISampling) -> list[Asked]:
    asked: list[Asked] = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            asked.append(Asked(GrammarSpec(GrammarKind.JSON_OBJECT), "response_format"))
        else:
            if fmt.json_schema is None:
                raise invalid_request(
                    "'response_format' of type json_schema needs 'json_schema': {\"name\": ..., \"schema\": {...}}",
                    param="response_format.json_schema",
                )
            schema = fmt.json_schema.json_schema if fmt.json_schema.json_schema is not None else {}
            asked.append(Asked(
                GrammarSpec(GrammarKind.JSON_SCHEMA, _schema_text(schema, "response_format.json_schema.schema")),
                "response_format",
            ))
    so = body.structured_outputs
    if so is not None:
        for name, field, kind in (("json", "json_schema", GrammarKind.JSON_SCHEMA), ("regex", "regex", GrammarKind.REGEX),
                                  ("choice", "choice", GrammarKind.CHOICE), ("grammar", "grammar", GrammarKind.LARK)):
            value = getattr(so, field)
            if value is not None:
                asked.append(_vllm_field(kind, value, f"structured_outputs.{name}"))
        if so.json_object:
            asked.append(Asked(GrammarSpec(GrammarKind.JSON_OBJECT), "structured_outputs.json_object"))
    for name, kind in (("guided_json", GrammarKind.JSON_SCHEMA), ("guided_regex", GrammarKind.REGEX),
                       ("guided_choice", GrammarKind.CHOICE), ("guided_grammar", GrammarKind.LARK)):
        value = getattr(body, name)
        if value is not None:
            asked.append(_vllm_field(kind, value, name))
    return asked


def _vllm_field(kind: GrammarKind, value: object, param: str) -> Asked:
    if kind == GrammarKind.JSON_SCHEMA:
        return Asked(GrammarSpec(kind, _schema_text(value, param)), param)
    if kind == GrammarKind.CHOICE:
        if not value or not all(isinstance(c, str) for c in value):
            raise invalid_request(f"'{param}' must be a non-empty list of strings", param=param)
        return Asked(GrammarSpec(kind, json.dumps(list(value))), param)
    return Asked(GrammarSpec(kind, value), param)


def checked(asked: Asked) -> GrammarSpec:
    """The grammar, if the engine takes it and it fits on the wire; else a 400 naming its field."""
    size = len(asked.spec.encode())
    if size > GRAMMAR_MAX_BYTES:
        raise invalid_request(
            f"'{asked.param}' takes {size} bytes; this server takes grammars of up to {GRAMMAR_MAX_BYTES}",
            param=asked.param,
        )
    problem = grammar_problem(asked.spec)
    if problem is not None:
        raise invalid_request(f"'{asked.param}' cannot be followed: {problem}", param=asked.param)
    return asked.spec


def requested_grammar(body: OpenAISampling) -> Asked | None:
    """The grammar the body asks its output to follow, if any (not yet checked: `checked`)."""
    asked = _asked(body)
    if len(asked) > 1:
        names = ", ".join(a.param for a in asked)
        raise invalid_request(f"the body asks for {len(asked)} output formats ({names}): ask for one", param=asked[1].param)
    return asked[0] if asked else None
