"""Tokenizing and chat templating off the event loop.

A long prompt takes the tokenizer tens to hundreds of milliseconds; on the event loop that would
freeze every stream for as long. Here it runs in a small thread pool. `Tokenizer.encode` releases
the GIL while the Rust tokenizer works (measured in docs/http_api.md), so neither the event loop nor
the engine thread waits for it; Jinja templating is Python and shares the GIL, but yields it every
switch interval. The prompt-length cap (validation.check_prompt_chars) bounds the work per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tp_runtime.chat import ChatMessage, render_chat
from tp_runtime.tokenizer import Tokenizer

T = TypeVar("T")


class TextWorker:
    def __init__(self, tokenizer: Tokenizer, threads: int = 2):
        self._tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A plain prompt, with what the model's files add to one (a BOS, if any)."""
        return await self.run(self._tokenizer.encode, text, add_special_tokens)

    async def encode_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, object]] = (),
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Messages (and tool definitions) through the model's chat template; raises ChatTemplateError.
        The template writes the special tokens (BOS, turn markers) itself: add_special_tokens only for
        a caller that asks (vLLM's /tokenize)."""

        def encode() -> list[int]:
            text = render_chat(self._tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt)
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

        return await self.run(encode)

    async def run(self, function: Callable[..., T], *args: object) -> T:
        """`function(*args)` on the pool: work on text that must not hold the event loop (tokenizing,
        templating, checking a grammar)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, function, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
