"""Chat messages -> prompt text, through the model's own chat template.

The template is Jinja from the model files (GGUF `tokenizer.chat_template` or tokenizer_config.json)
and so is untrusted input: it renders in Jinja's immutable sandbox, which refuses access to Python
internals and mutation of the arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from protocol.errors import TPRuntimeError

if TYPE_CHECKING:
    from tp_runtime.tokenizer import Tokenizer

# Roles that chat templates understand; anything else is refused with a sentence up front instead
# of a template that silently renders nonsense.
ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatTemplateError(TPRuntimeError, ValueError):
    """The messages cannot be rendered: a malformed list, no template, or a template that fails."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def _raise_exception(message: str) -> None:
    # Templates call raise_exception(...) to refuse a conversation (e.g. roles out of order).
    raise ChatTemplateError(f"the model's chat template refused these messages: {message}")


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # The same environment options as transformers' apply_chat_template, so templates written
    # for it render identically here.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(template)
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


def parse_messages(messages: object) -> list[ChatMessage]:
    """Checks a messages list as a client sent it (JSON-shaped) and returns typed messages."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise ChatTemplateError(f"messages must be a list of messages, not {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages is empty: send at least one message")
    parsed = []
    for index, message in enumerate(messages):
        if isinstance(message, ChatMessage):
            role, content = message.role, message.content
        elif isinstance(message, Mapping):
            role, content = message.get("role"), _content_text(index, message.get("content"))
        else:
            raise ChatTemplateError(
                f"messages[{index}] must be an object with role and content, not {type(message).__name__}"
            )
        if role not in ROLES:
            raise ChatTemplateError(f"messages[{index}].role is {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ChatTemplateError(f"messages[{index}].content must be a string")
        parsed.append(ChatMessage(role=role, content=content))
    return parsed


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage | Mapping[str, object]],
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for `messages`, ending with the assistant's turn header. The text carries the
    template's special tokens: encode it with add_special_tokens=False."""
    template = tokenizer.chat_template
    if template is None:
        raise ChatTemplateError("this model has no chat template: send a plain prompt instead")
    parsed = parse_messages(messages)
    try:
        return _compile(template).render(
            messages=[{"role": m.role, "content": m.content} for m in parsed],
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template failed on these messages: {exc}") from exc
