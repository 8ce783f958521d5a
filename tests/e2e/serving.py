"""The end-to-end tests' server: a tiny model and raw `tp-runtime serve` flags, on scripts/harness.

Processes are started, found and stopped by pid by `scripts.harness.runtime.RuntimeServer`; the
names here keep the e2e tests' vocabulary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from scripts.harness.processes import alive, descendants, rank_label
from scripts.harness.runtime import RuntimeServer, ServerOptions, process_label

__all__ = ["SERVER_OPTIONS", "Server", "alive", "descendants", "rank_pid"]

# Small enough that a TP=2 step over gloo is a few milliseconds; 3 KV groups over 2 ranks exercise
# the uneven head split.
SERVER_OPTIONS = (
    "--dtype", "fp32", "--num-kv-pages", "256", "--max-model-len", "256", "--max-num-seqs", "32",
    "--max-num-batched-tokens", "256",
)  # fmt: skip


class Server(RuntimeServer):
    """Started and healthy once constructed; whoever constructs it calls stop() in a finally."""

    def __init__(self, model: str | Path, *, tp: int = 1, extra: Sequence[str] = (), startup_s: float = 180) -> None:
        super().__init__(ServerOptions(model=str(model), tensor_parallel_size=tp, extra_args=tuple(extra)))
        self.start(timeout_s=startup_s)


def rank_pid(root: int, rank: int) -> int:
    """The torchrun worker of `rank` below the launcher `root`."""
    for pid in descendants(root):
        if process_label(pid) == rank_label(rank):
            return pid
    raise LookupError(f"no process of rank {rank} below {root}")


class RecordedStream:
    """One streaming completion read on a thread of its own: every line it got, and when it ended
    (a transport error is recorded as a line)."""

    def __init__(self, url: str, prompt: str, max_tokens: int, timeout_s: float = 30, **fields: object) -> None:
        self.lines: list[str] = []
        self.ended_at: float | None = None
        self._first_data = threading.Event()
        self._body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, **fields}
        self._url, self._timeout_s = url, timeout_s
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        assert self._first_data.wait(60), "the stream never started"

    def _read(self) -> None:
        try:
            with httpx.stream("POST", f"{self._url}/v1/completions", json=self._body, timeout=self._timeout_s) as response:
                for line in response.iter_lines():
                    self.lines.append(line)
                    if line.startswith("data: "):
                        self._first_data.set()
        except httpx.HTTPError as exc:
            self.lines.append(f"transport error: {exc!r}")
        finally:
            self.ended_at = time.monotonic()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout=timeout_s)
