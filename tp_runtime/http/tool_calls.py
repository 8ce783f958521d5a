"""Tool calls on /v1/chat/completions: what tools and tool_choice ask of the output, and the calls
read back from it, in OpenAI's shapes (whole answers and stream deltas).

- `none`: the tools are still shown to the template (vLLM's default); the output is text.
- `auto` (the default with tools): the model may call tools in the Hermes format
  (tp_runtime/tool_format.py); the text outside the calls is the content.
- `required`, and a named function: the output is constrained by a JSON schema through the
  structured-output engine, as vLLM does: a non-empty list of {"name", "parameters"} objects, one
  of the tools each (one object at most with parallel_tool_calls false), or the named function's
  arguments. What the model writes therefore always parses into calls.

A stream sends text as it comes, holding back whatever could start a call; calls go out whole, each
in one delta with its index, id, type, name and arguments, once the output has ended (OpenAI's
clients accumulate deltas, so a whole call is a valid delta), and the finish reason is then
"tool_calls".
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from protocol.grammar import GrammarKind, GrammarSpec
from tp_runtime.http.api_models import ChatCompletionRequest, FunctionCall, NamedToolChoice, ToolCallDelta, ToolCallOut
from tp_runtime.http.errors import invalid_request
from tp_runtime.tool_format import CALL_OPEN, ParsedCall, parse_hermes

FINISH_TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of its output."""

    mode: str  # "none", "auto", "required" or "named"
    tools: tuple[dict, ...]  # OpenAI's tool definitions, as the template gets them
    named: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def grammar(self) -> GrammarSpec | None:
        """The output's JSON schema for `required` and a named function; None otherwise."""
        functions = {t["function"]["name"]: t["function"] for t in self.tools}
        if self.mode == "named":
            return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(_parameters(functions[self.named])))
        if self.mode != "required":
            return None
        items = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [name]}, "parameters": _parameters(f)},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, f in functions.items()
            ]
        }
        schema: dict = {"type": "array", "minItems": 1, "items": items}
        if not self.parallel:
            schema["maxItems"] = 1
        return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))

    def calls(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a whole output."""
        if self.mode == "named":
            return None, [ParsedCall(self.named or "", _compact(text))]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []  # cut short by max_tokens: no call can be read
            return None, [ParsedCall(i["name"], json.dumps(i.get("parameters", {}))) for i in items][
                : None if self.parallel else 1
            ]
        content, calls = parse_hermes(text)
        if not self.parallel:
            calls = calls[:1]
        return (content or None) if calls else content, calls


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text))
    except ValueError:
        return text


def plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan, or None when it has no tools (a tool_choice other than none is then
    refused, as OpenAI does)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise invalid_request("'tool_choice' needs 'tools': send the tools it may choose from", param="tool_choice")
        return None
    tools = tuple(t.model_dump(exclude_none=True) for t in body.tools)
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise invalid_request(f"'tools' names a function twice: {names}", param="tools")
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise invalid_request(
                f"'tool_choice' names {choice.function.name!r}, which is not among the tools ({', '.join(names)})",
                param="tool_choice",
            )
        return ToolPlan("named", tools, choice.function.name, parallel)
    return ToolPlan(choice or "auto", tools, None, parallel)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_out(calls: list[ParsedCall]) -> list[ToolCallOut]:
    return [ToolCallOut(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


class ToolCallStream:
    """One choice's stream: text that cannot be part of a call goes out as it comes, the rest is
    held until the output ends and is then read for calls."""

    def __init__(self, plan_: ToolPlan):
        self._plan = plan_
        self._text = ""
        self._sent = 0
        # required/named: the whole output is the calls; auto: text until a call starts.
        self._holding = plan_.mode in ("required", "named")

    def feed(self, text: str) -> str:
        """The content that may go out now."""
        self._text += text
        if self._holding:
            return ""
        start = self._text.find(CALL_OPEN, self._sent)
        if start >= 0:
            self._holding = True
            out, self._sent = self._text[self._sent : start], start
            return out
        keep = _open_prefix(self._text, CALL_OPEN)
        end = max(len(self._text) - keep, self._sent)
        out, self._sent = self._text[self._sent : end], end
        return out

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """(the content still held, the calls as deltas) once the output has ended."""
        rest = self._text[self._sent :]
        self._sent = len(self._text)
        if not rest:
            return "", []
        if self._plan.mode == "auto":
            content, calls = self._plan.calls(rest)
        else:
            content, calls = self._plan.calls(self._text)
        deltas = [
            ToolCallDelta(index=i, id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for i, c in enumerate(calls)
        ]
        return (content or "") if calls else rest, deltas


def _open_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could start `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0
