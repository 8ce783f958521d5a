"""How tool definitions and tool-call histories reach a chat template, and how a model's tool calls
are read back from its text.

A template that reads `tools` (Hermes, Qwen 2.5, Llama 3.1 and Mistral templates do) renders them
itself; it gets the history as transformers hands it over: an assistant message's `tool_calls` with
their arguments as objects, a tool message's `tool_call_id`. Any other template (SmolLM2's ChatML
among them) gets the documented default, the Hermes format that NousResearch's Hermes models and
Qwen use and that vLLM's `hermes` parser reads: the tools as JSON inside <tools></tools> in the
system message, each call as {"name": ..., "arguments": {...}} inside <tool_call></tool_call>, each
result inside <tool_response></tool_response> in a message of role `tool`. Output is read back in
the same format (parse_hermes), whatever the template.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tp_runtime.chat import ChatMessage

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


@dataclass(frozen=True)
class ParsedCall:
    """A call read from a model's text: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def _arguments_object(arguments: str) -> object:
    """A call's arguments as a template wants them: the object its JSON text holds (the text itself
    when it is not JSON, so that a history with a malformed call still renders)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def native_message(message: ChatMessage) -> dict[str, object]:
    shaped: dict[str, object] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        shaped["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments_object(c.arguments)}}
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        shaped["tool_call_id"] = message.tool_call_id
    return shaped


def hermes_call(name: str, arguments: str) -> str:
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': _arguments_object(arguments)})}\n{CALL_CLOSE}"


def hermes_messages(messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, object]]) -> list[dict[str, str]]:
    """The messages with tools, calls and results written in the Hermes format, for a template that
    renders role and content only."""
    shaped = []
    for m in messages:
        content = m.content
        if m.tool_calls:
            calls = "\n".join(hermes_call(c.name, c.arguments) for c in m.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        elif m.role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        shaped.append({"role": m.role, "content": content})
    if tools:
        listing = "\n".join(json.dumps(tool) for tool in tools)
        system = HERMES_SYSTEM.format(tools=listing)
        if shaped and shaped[0]["role"] == "system":
            shaped[0] = {"role": "system", "content": f"{shaped[0]['content']}\n\n{system}"}
        else:
            shaped.insert(0, {"role": "system", "content": system})
    return shaped


def parse_hermes(text: str) -> tuple[str, list[ParsedCall]]:
    """(the text outside the calls, the calls) of a model's output in the Hermes format. A block that
    does not hold {"name": str, "arguments": object} stays text: it is not a call."""
    calls: list[ParsedCall] = []
    kept: list[str] = []
    end = 0
    for match in _CALL.finditer(text):
        call = _call_of(match.group(1))
        if call is None:
            continue
        kept.append(text[end : match.start()])
        calls.append(call)
        end = match.end()
    kept.append(text[end:])
    return "".join(kept).strip() if calls else text, calls


def _call_of(body: str) -> ParsedCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(data, dict) and isinstance(data.get("name"), str)):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(data["name"], json.dumps(arguments))
