"""Chat messages -> prompt text, through the model's own chat template.

The template is Jinja from the model files (GGUF `tokenizer.chat_template` or tokenizer_config.json)
and so is untrusted input: it renders in Jinja's immutable sandbox, which refuses access to Python
internals and mutation of the arguments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from protocol.errors import TPRuntimeError
from tp_runtime import tool_format

if TYPE_CHECKING:
    from tp_runtime.tokenizer import Tokenizer

# Roles that chat templates understand; anything else is refused with a sentence up front instead
# of a template that silently renders nonsense.
ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatTemplateError(TPRuntimeError, ValueError):
    """The messages cannot be rendered: a malformed list, no template, or a template that fails."""


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant message made: OpenAI's {"id", "type": "function", "function": {"name",
    "arguments"}}, arguments as the JSON text the model wrote."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    # An assistant message's calls, and a tool message's answer to one (OpenAI's tool_call_id).
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


def _raise_exception(message: str) -> None:
    # Templates call raise_exception(...) to refuse a conversation (e.g. roles out of order).
    raise ChatTemplateError(f"the model's chat template refused these messages: {message}")


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    # The same environment options as transformers' apply_chat_template, so templates written
    # for it render identically here.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    return env


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the model's chat template does not parse: {exc}") from exc


def _content_text(index: int, content: object) -> str:
    """A message's content: a string, or OpenAI's list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part_index, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ChatTemplateError(
                    f"messages[{index}].content[{part_index}] must be {{\"type\": \"text\", \"text\": ...}}: "
                    "only text content is supported"
                )
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        raise ChatTemplateError(f"messages[{index}].content is missing")
    raise ChatTemplateError(f"messages[{index}].content must be a string, not {type(content).__name__}")


def _tool_calls(index: int, calls: object) -> tuple[ToolCall, ...]:
    if calls is None:
        return ()
    if not isinstance(calls, Sequence) or isinstance(calls, str | bytes):
        raise ChatTemplateError(f"messages[{index}].tool_calls must be a list of tool calls")
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not (
            isinstance(function, Mapping)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)
            and isinstance(call.get("id", ""), str)
        ):
            raise ChatTemplateError(
                f"messages[{index}].tool_calls[{k}] must be {{\"id\": ..., \"type\": \"function\", \"function\": "
                "{\"name\": ..., \"arguments\": \"<JSON text>\"}}"
            )
        out.append(ToolCall(call.get("id", ""), function["name"], function["arguments"]))
    return tuple(out)


def parse_messages(messages: object) -> list[ChatMessage]:
    """Checks a messages list as a client sent it (JSON-shaped) and returns typed messages."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise ChatTemplateError(f"messages must be a list of messages, not {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages is empty: send at least one message")
    parsed = []
    for index, message in enumerate(messages):
        if isinstance(message, ChatMessage):
            parsed.append(message)
            continue
        if not isinstance(message, Mapping):
            raise ChatTemplateError(
                f"messages[{index}] must be an object with role and content, not {type(message).__name__}"
            )
        role = message.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"messages[{index}].role is {role!r}; expected one of {', '.join(ROLES)}")
        calls = _tool_calls(index, message.get("tool_calls")) if role == "assistant" else ()
        # An assistant message that only calls tools has no content (OpenAI sends null).
        raw = message.get("content")
        content = "" if raw is None and calls else _content_text(index, raw)
        call_id = message.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise ChatTemplateError(f"messages[{index}].tool_call_id must be a string")
        parsed.append(ChatMessage(role=role, content=content, tool_calls=calls, tool_call_id=call_id))
    return parsed


def load_chat_template(template: str) -> str:
    """--chat-template: a file holding a Jinja template, or the template itself (as vLLM takes it);
    checked to parse."""
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            template = f.read()
    elif "{" not in template:
        raise ChatTemplateError(f"{template!r} is neither a file nor a Jinja template")
    _compile(template)
    return template


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage | Mapping[str, object]],
    *,
    tools: Sequence[Mapping[str, object]] = (),
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for `messages`, ending with the assistant's turn header. The text carries the
    template's special tokens: encode it with add_special_tokens=False.

    `tools` are OpenAI's tool definitions ({"type": "function", "function": {...}}). A template that
    knows tools (it reads the `tools` variable, as Hermes, Qwen and Llama 3.1 templates do) gets them
    and the tool-call history as transformers passes them (arguments as objects); any other template
    gets the Hermes format written into the messages (tp_runtime/tool_format.py)."""
    template = tokenizer.chat_template
    if template is None:
        raise ChatTemplateError("this model has no chat template: send a plain prompt instead")
    parsed = parse_messages(messages)
    native = template_knows_tools(template)
    if native:
        shaped = [tool_format.native_message(m) for m in parsed]
    else:
        shaped = tool_format.hermes_messages(parsed, tools)
    try:
        return _compile(template).render(
            messages=shaped,
            tools=list(tools) if tools and native else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template failed on these messages: {exc}") from exc


def template_knows_tools(template: str) -> bool:
    """Whether a template renders tool definitions itself: it reads the `tools` variable."""
    _compile(template)  # a template that does not parse is refused with its reason
    return "tools" in jinja2.meta.find_undeclared_variables(_environment().parse(template))
