"""The end-to-end tests' server: a tiny model and raw `tp-runtime serve` flags, on scripts/harness.

Processes are started, found and stopped by pid by `scripts.harness.runtime.RuntimeServer`; the
names here keep the e2e tests' vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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
