"""A fast GGUF reader: the metadata header, the tensor directory, and zero-copy tensor data.

gguf.GGUFReader builds a numpy view for every part of every metadata field, which takes 5-25 s
on this machine for SmolLM2's 49k-token vocabulary (and once per rank). This reads the header
with struct.unpack_from over one memory map and keeps tensor data as views into that map; the
gguf package is still what dequantizes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocol.errors import TPRuntimeError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format of a scalar.
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# ggml types whose data is a plain typed array (everything else is raw bytes in blocks).
TYPED = {0: np.float32, 1: np.float16}


# ggml's 4-bit block types: bytes per block of 32 weights (a float16 scale d, for Q4_1 a float16
# minimum m, then 16 bytes of nibbles: element j in the low nibble of byte j, element j + 16 in its
# high nibble). Q4_0 means w = (q - 8) * d, Q4_1 w = q * d + m.
Q4_0, Q4_1 = 2, 3
Q4_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20}
Q4_BLOCK = 32


class GGUFFormatError(TPRuntimeError, ValueError):
    """The bytes do not follow the GGUF format."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # logical order, outermost first: (rows, cols) for a matrix
    data: np.ndarray  # float32/float16 [rows, cols], or uint8 [rows, bytes per row] for blocks


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        with self.path.open("rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._take(4) != MAGIC:
            raise GGUFFormatError("bad magic: not a GGUF file")
        (version,) = self._unpack("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
        tensor_count, kv_count = self._unpack("<QQ")
        self.metadata: dict[str, object] = {}
        for _ in range(kv_count):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.metadata[key] = self._value(kind)
        directory = []
        for _ in range(tensor_count):
            name = self._string()
            (dims,) = self._unpack("<I")
            ggml_shape = self._unpack(f"<{dims}Q")
            kind, offset = self._unpack("<IQ")
            directory.append((name, kind, tuple(reversed(ggml_shape)), offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, kind, shape, offset in directory:
            try:
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise GGUFFormatError(f"tensor {name} has unknown ggml type {kind}") from None
            cols = shape[-1]
            rows = int(np.prod(shape[:-1], dtype=np.int64))
            if cols % block:
                raise GGUFFormatError(f"tensor {name}: {cols} columns are not whole blocks of {block}")
            row_bytes = cols // block * block_bytes
            start = data_start + offset
            if start + rows * row_bytes > len(self._map):
                raise GGUFFormatError(f"tensor {name} runs past the end of the file: it is truncated")
            raw = np.frombuffer(self._map, dtype=np.uint8, count=rows * row_bytes, offset=start)
            data = raw.view(TYPED[kind]) if kind in TYPED else raw
            self.tensors[name] = GGUFTensor(name, kind, shape, data.reshape(rows, -1))

    def _take(self, size: int) -> bytes:
        end = self._pos + size
        if end > len(self._map):
            raise GGUFFormatError("the header ends early: the file is truncated")
        chunk = self._map[self._pos : end]
        self._pos = end
        return chunk

    def _unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._map):
            raise GGUFFormatError("the header ends early: the file is truncated")
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += size
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        return self._take(length).decode("utf-8", errors="replace")

    def _strings(self, count: int) -> list[str]:
        """An array of strings (a vocabulary: 49k for SmolLM2, read by every process that opens
        the file) in one tight loop: a third of the time of one _string call per item."""
        data, pos, end, unpack = self._map, self._pos, len(self._map), struct.unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFFormatError("the header ends early: the file is truncated")
            (length,) = unpack("<Q", data, pos)
            pos += 8
            if pos + length > end:
                raise GGUFFormatError("the header ends early: the file is truncated")
            out.append(data[pos : pos + length].decode("utf-8", errors="replace"))
            pos += length
        self._pos = pos
        return out

    def _value(self, kind: int) -> object:
        if kind == STRING:
            return self._string()
        if kind in SCALARS:
            return self._unpack("<" + SCALARS[kind])[0]
        if kind == ARRAY:
            item_kind, length = self._unpack("<IQ")
            if item_kind in SCALARS:
                return list(self._unpack(f"<{length}{SCALARS[item_kind]}"))
            if item_kind == STRING:
                return self._strings(length)
            return [self._value(item_kind) for _ in range(length)]
        raise GGUFFormatError(f"unknown metadata value type {kind}")


@dataclass(frozen=True)
class Q4Blocks:
    """Rows of 4-bit weights in GGUF's blocks of 32 along the input dimension: w = q * scale + low."""

    q: np.ndarray  # uint8 [rows, cols], values 0..15
    scale: np.ndarray  # float32 [rows, cols // 32]
    low: np.ndarray  # float32 [rows, cols // 32]

    @classmethod
    def parse(cls, raw: np.ndarray, ggml_type: int) -> Q4Blocks:
        """raw: uint8 [rows, whole blocks' bytes] of a Q4_0 or Q4_1 tensor (or a slice of one)."""
        rows = raw.shape[0]
        blocks = np.ascontiguousarray(raw).reshape(rows, -1, Q4_BLOCK_BYTES[ggml_type])
        scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if ggml_type == Q4_1:
            low = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        else:
            low = -8.0 * scale
        nibbles = blocks[..., -Q4_BLOCK // 2 :]
        q = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(rows, -1)
        return cls(q, scale, low)

    @classmethod
    def cat(cls, parts: list[Q4Blocks]) -> Q4Blocks:
        """Row-wise concatenation (fused QKV, fused gate/up)."""
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("q", "scale", "low")))

    def take_rows(self, order: np.ndarray) -> Q4Blocks:
        return Q4Blocks(self.q[order], self.scale[order], self.low[order])

    def dequantize(self) -> np.ndarray:
        rows = self.q.shape[0]
        q = self.q.reshape(rows, -1, Q4_BLOCK).astype(np.float32)
        return (q * self.scale[..., None] + self.low[..., None]).reshape(rows, -1)
