"""One rank's loaded shard of a GGUF model, kept on disk so that the next start maps it instead of
dequantizing the file again.

Dequantizing SmolLM2's 4-bit blocks to fp32 costs 2-5 s of CPU per start on the machines these
sessions get (most of a `generate`'s start); the shard it yields, as safetensors on disk, maps in
milliseconds and is checked in about 0.2 s (crc32 of every tensor). What is kept is what
executor/model/load.py's reader yields before the matrices are packed for the kernels (oneDNN's
packed layout is opaque and is rebuilt at each start): each dense slice in the compute dtype, each
norm in fp32, each 4-bit slice's blocks.

An entry is named by what its content depends on (`ShardKey`): the model file (path, size, mtime and
sampled bytes), the dtype, the weight format, the TP size and rank, and the code that fills it (the
digest of the modules that read, slice and dequantize). Any change finds no entry and builds a new
one, which replaces the old entry of the same model, TP size, rank, dtype and format. An entry is
written whole (to a temporary name, then renamed); one that does not parse, was made for another
key, or whose bytes do not match their checksums is refused with a warning, removed and rebuilt,
never read.

It serves GGUF files on the CPU: a Hugging Face directory already maps its safetensors, and a GPU
load's cost is elsewhere. TP_RUNTIME_WEIGHT_CACHE=off turns it off. The root is executor/disk_cache.py's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from executor.disk_cache import cache_root, digest
from executor.gguf_file import Q4Blocks
from protocol.errors import TPRuntimeError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ENV = "TP_RUNTIME_WEIGHT_CACHE"
_Q4_FIELDS = ("q", "scale", "low")


# The code that decides what an entry holds (this module's included), by path under executor/:
# its modules are read, not imported (executor.model.load imports this one).
_DECIDING_FILES = (
    "gguf_file.py", "model/config.py", "model/gguf_source.py", "model/load.py", "model/sharding.py", "model/source.py",
    "weight_cache.py",
)  # fmt: skip


@functools.cache
def _code_digest() -> str:
    """A digest of the code that decides what an entry holds: an edit to any of it makes every key
    new."""
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in _DECIDING_FILES)).hexdigest()[:16]


@dataclass(frozen=True)
class ShardKey:
    """What one rank's loaded shard depends on."""

    model: str  # the resolved path
    size: int
    mtime_ns: int
    files_digest: str  # sampled bytes (executor.model.source.files_digest)
    dtype: str
    weight_format: str  # resolved: dense, int4 or mixed
    world_size: int
    rank: int
    deterministic: bool  # --deterministic holds other matrices (int4 for mixed, TP=1's split halves)
    code: str
    version: int = FORMAT_VERSION

    def slot(self) -> str:
        """The entry's place: one per model path, dtype, format, TP size, rank and mode."""
        return digest({"model": self.model, "dtype": self.dtype, "format": self.weight_format,
                       "world_size": self.world_size, "rank": self.rank, "deterministic": self.deterministic})

    def name(self) -> str:
        return f"{self.slot()}-{digest(asdict(self))}.safetensors"


def shard_key(
    path: Path, files_digest: str, dtype: torch.dtype, weight_format: str, world_size: int, rank: int, deterministic: bool
) -> ShardKey:
    resolved = path.resolve()
    stat = resolved.stat()
    return ShardKey(
        model=str(resolved), size=stat.st_size, mtime_ns=stat.st_mtime_ns, files_digest=files_digest,
        dtype=str(dtype).removeprefix("torch."), weight_format=weight_format, world_size=world_size, rank=rank,
        deterministic=deterministic, code=_code_digest(),
    )


def weights_dir() -> Path:
    return cache_root() / "weights"


class CacheRefused(TPRuntimeError):
    """An entry that must not be read: the sentence says why."""


class ShardCache:
    """The loader's reads of one shard: served from a verified entry, or computed and recorded for
    `commit` to write. `tensor(name, compute)` and `q4(name, compute)` are the loader's two doors."""

    def __init__(self, key: ShardKey | None) -> None:
        self.key = key
        self.path = weights_dir() / key.name() if key is not None else None
        self._stored: dict[str, torch.Tensor] = {}
        self._absent: set[str] = set()  # 4-bit reads that found no 4-bit blocks
        self._recorded: dict[str, torch.Tensor] = {}
        # What a miss may hold in memory until `commit` (the dense copies stay alive beside the packed
        # ones): a quarter of the memory available now. A larger shard is loaded but not kept.
        self._budget = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
        self.hit = False
        if self.path is not None and self.path.is_file():
            try:
                self._stored, self._absent = read_entry(self.path, key)
                self.hit = True
            except CacheRefused as refused:
                log.warning(f"weight cache entry {self.path} refused ({refused}); rebuilding it")
                self.path.unlink(missing_ok=True)

    def tensor(self, name: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        if name in self._stored:
            return self._stored[name]
        value = compute()
        self._record(name, value)
        return value

    def q4(self, name: str, compute: Callable[[], Q4Blocks | None]) -> Q4Blocks | None:
        if name in self._absent:
            return None
        if all(f"{name}.{f}" in self._stored for f in _Q4_FIELDS):
            return Q4Blocks(*(self._stored[f"{name}.{f}"].numpy() for f in _Q4_FIELDS))
        blocks = compute()
        if blocks is None:
            self._absent.add(name)
        else:
            for f in _Q4_FIELDS:
                self._record(f"{name}.{f}", torch.from_numpy(np.ascontiguousarray(getattr(blocks, f))))
        return blocks

    def _record(self, name: str, value: torch.Tensor) -> None:
        if self.key is None:
            return
        self._budget -= value.numel() * value.element_size()
        if self._budget < 0:
            log.info(f"weight cache: this shard is too large to keep ({self.path} not written)")
            self.key, self._recorded = None, {}
            return
        self._recorded[name] = value

    def commit(self) -> None:
        """Writes what this load computed, if anything (a hit computes nothing)."""
        if self.key is None or not self._recorded:
            return
        try:
            write_entry(self.path, self.key, {**self._stored, **self._recorded}, self._absent)
        except OSError as exc:  # a full or read-only disk costs the next start its time, nothing else
            log.warning(f"weight cache entry {self.path} not written: {exc}")


def open_cache(enabled: bool, key: Callable[[], ShardKey]) -> ShardCache:
    """The cache of this load: a pass-through one where it does not apply or is turned off."""
    if not enabled or os.environ.get(ENV, "on") == "off":
        return ShardCache(None)
    return ShardCache(key())


def _checksum(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.contiguous().view(torch.uint8).numpy())


def write_entry(path: Path, key: ShardKey, tensors: dict[str, torch.Tensor], absent: set[str]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    metadata = {
        "key": json.dumps(asdict(key), sort_keys=True),
        "crc32": json.dumps({name: _checksum(t) for name, t in tensors.items()}, sort_keys=True),
        "absent": json.dumps(sorted(absent)),
    }
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(temporary), metadata=metadata)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    for stale in path.parent.glob(f"{key.slot()}-*.safetensors"):
        if stale != path:
            stale.unlink(missing_ok=True)


def read_entry(path: Path, key: ShardKey) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The entry's tensors (mapped, not copied) once every check has passed; CacheRefused otherwise."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as entry:
            metadata = entry.metadata() or {}
            if json.loads(metadata.get("key", "null")) != asdict(key):
                raise CacheRefused("it was made for another model, dtype, format, TP size or code")
            sums = json.loads(metadata["crc32"])
            absent = set(json.loads(metadata["absent"]))
            tensors = {name: entry.get_tensor(name) for name in entry.keys()}  # noqa: SIM118 (safe_open has no iterator)
    except CacheRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a damaged file makes the parser raise
        raise CacheRefused(f"unreadable: {exc}") from None
    if set(sums) != set(tensors):
        raise CacheRefused("its tensors and its checksums disagree")
    for name, tensor in tensors.items():
        if _checksum(tensor) != sums[name]:
            raise CacheRefused(f"tensor {name} does not match its checksum")
    return tensors, absent
