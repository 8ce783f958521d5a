"""Where an executor keeps what it measured and compiled on this machine, and how it names it.

Two things live there: the start-up probe's choice of dtype and weight format (executor/probe.py)
and AOTInductor-compiled decode layers (executor/model/compiled.py). Both are keyed by what they
depend on, so a different CPU, torch version or model shape finds nothing and builds its own; an
entry is written whole (to a temporary name, then renamed) so that a reader never sees half of one.

The root is $TP_RUNTIME_CACHE_DIR, else $XDG_CACHE_HOME/tp-runtime, else ~/.cache/tp-runtime.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    explicit = os.environ.get("TP_RUNTIME_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tp-runtime"


@cache
def cpu_identity() -> dict[str, str]:
    """What a measurement or a compiled kernel of this CPU depends on: its model and instruction
    set flags (a kernel built for AVX-512 dies on an AVX2-only CPU), and torch's build."""
    import torch

    model, flags = platform.processor(), ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not flags:
                model = value.strip()
            elif key.strip() == "flags":
                flags = " ".join(sorted(value.split()))
                break
    return {
        "cpu": model,
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "machine": platform.machine(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def digest(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


@contextlib.contextmanager
def file_lock(path: Path, *, blocking: bool = True) -> Iterator[bool]:
    """An exclusive flock on `path` (created if needed) for the block; yields False, without
    waiting, when `blocking` is off and another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
