"""What a weight source is (GGUF file or Hugging Face directory: gguf_source.py, hf_source.py), and
what both kinds share: the check that a checkpoint holds no tensor the forward would skip, slice
bounds, and the cheap digest of weight files the model fingerprint uses.

A source answers `read(key, layer, rows, cols)` with a float32 tensor of that slice, and
`read_q4` with the slice's 4-bit blocks where the file stores it so; each rank reads only its
slices (executor/model/load.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

import torch

from executor.gguf_file import Q4Blocks
from executor.model.config import ModelConfig, ModelLoadError, UnsupportedModelError

Range = tuple[int, int]

GLOBAL_KEYS = ("embed", "final_norm", "lm_head")
BIAS_KEYS = ("q_bias", "k_bias", "v_bias")
def expected_tensors(names: dict[str, str], config: ModelConfig) -> set[str]:
    """Every tensor name the forward reads: a checkpoint with others holds weights it would skip."""
    layer_keys = [k for k in names if k not in GLOBAL_KEYS and (config.qkv_bias or k not in BIAS_KEYS)]
    expected = {names[k] for k in GLOBAL_KEYS}
    expected.update(names[k].format(layer) for layer in range(config.num_layers) for k in layer_keys)
    return expected


def refuse_unused(source: str, present: set[str], expected: set[str], config: ModelConfig) -> None:
    unused = sorted(present - expected)
    if unused:
        shown = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
        raise UnsupportedModelError(
            f"{source}: holds tensors that a {config.architecture} model of this runtime does not use "
            f"({shown}); running without them would compute another model"
        )


class WeightSource(Protocol):
    config: ModelConfig
    files: list[Path]

    def has(self, key: str, layer: int | None = None) -> bool: ...

    def stores_q4(self) -> bool: ...

    def read(
        self, key: str, layer: int | None = None, rows: Range | None = None, cols: Range | None = None
    ) -> torch.Tensor: ...

    def read_q4(
        self, key: str, layer: int | None = None, rows: Range | None = None, cols: Range | None = None
    ) -> Q4Blocks | None: ...


def check_slice(shape: tuple[int, ...], rows: Range | None, cols: Range | None, name: str) -> None:
    for axis, span in ((0, rows), (1, cols)):
        if span is not None and not 0 <= span[0] <= span[1] <= shape[axis]:
            raise ModelLoadError(f"{name}: slice {span} is outside dimension {axis} of shape {shape}")



def files_digest(files: list[Path], samples: int = 64, sample_bytes: int = 4096) -> str:
    """A cheap digest of weight files: sizes plus evenly spaced byte samples.

    Hashing whole checkpoints would cost seconds per GiB on every start; sampled bytes still tell
    apart any two checkpoints that differ in more than a handful of weights.
    """
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as handle:
            for index in range(samples):
                handle.seek(size * index // samples)
                digest.update(handle.read(sample_bytes))
            handle.seek(max(0, size - sample_bytes))
            digest.update(handle.read(sample_bytes))
    return digest.hexdigest()
