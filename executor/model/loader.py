"""Weight loading from GGUF files and Hugging Face directories; each rank reads only its slices.

A source answers `read(key, layer, rows, cols)` with a float32 tensor of that slice, and
`read_q4` with the slice's 4-bit blocks where the file stores it so. GGUF quantized tensors are
sliced before they are dequantized: their blocks run along the input dimension, so whole output
rows (and block-aligned input columns) are byte ranges of the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from executor.model.config import ModelConfig, ModelLoadError, config_from_hf
from executor.gguf_file import Q4_BLOCK_BYTES, GGUFFile, GGUFFormatError, GGUFTensor, Q4Blocks

log = logging.getLogger(__name__)

Range = tuple[int, int]

GGUF_NAMES = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
    "attn_norm": "blk.{}.attn_norm.weight",
    "q": "blk.{}.attn_q.weight",
    "k": "blk.{}.attn_k.weight",
    "v": "blk.{}.attn_v.weight",
    "o": "blk.{}.attn_output.weight",
    "ffn_norm": "blk.{}.ffn_norm.weight",
    "gate": "blk.{}.ffn_gate.weight",
    "up": "blk.{}.ffn_up.weight",
    "down": "blk.{}.ffn_down.weight",
}
HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "model.layers.{}.input_layernorm.weight",
    "q": "model.layers.{}.self_attn.q_proj.weight",
    "k": "model.layers.{}.self_attn.k_proj.weight",
    "v": "model.layers.{}.self_attn.v_proj.weight",
    "o": "model.layers.{}.self_attn.o_proj.weight",
    "ffn_norm": "model.layers.{}.post_attention_layernorm.weight",
    "gate": "model.layers.{}.mlp.gate_proj.weight",
    "up": "model.layers.{}.mlp.up_proj.weight",
    "down": "model.layers.{}.mlp.down_proj.weight",
}


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


def _slice_2d(shape: tuple[int, ...], rows: Range | None, cols: Range | None, name: str) -> None:
    for axis, span in ((0, rows), (1, cols)):
        if span is not None and not 0 <= span[0] <= span[1] <= shape[axis]:
            raise ModelLoadError(f"{name}: slice {span} is outside dimension {axis} of shape {shape}")


class GGUFSource:
    """A llama-architecture GGUF file (llama.cpp's converter layout)."""

    def __init__(self, path: Path) -> None:
        self.files = [path]
        try:
            self.file = GGUFFile(path)
        except (GGUFFormatError, OSError, ValueError) as error:
            raise ModelLoadError(f"{path}: not a readable GGUF file ({error})") from None
        self.tensors = self.file.tensors
        self.config = self._config(path)
        if "rope_freqs.weight" in self.tensors:
            raise ModelLoadError(
                f"{path}: per-frequency rotary factors (rope_freqs.weight, Llama 3.1 GGUF) are not "
                "supported; load the Hugging Face directory instead"
            )

    def _field(self, key: str, default: object = None) -> object:
        return self.file.metadata.get(key, default)

    def _config(self, path: Path) -> ModelConfig:
        arch = self._field("general.architecture")
        if arch != "llama":
            raise ModelLoadError(f"{path}: architecture {arch!r} is not a Llama-family model")
        try:
            num_heads = int(self._field("llama.attention.head_count"))
            hidden = int(self._field("llama.embedding_length"))
            vocab = self._field("llama.vocab_size") or len(self._field("tokenizer.ggml.tokens", []))
            config = ModelConfig(
                vocab_size=int(vocab),
                hidden_size=hidden,
                intermediate_size=int(self._field("llama.feed_forward_length")),
                num_layers=int(self._field("llama.block_count")),
                num_heads=num_heads,
                num_kv_heads=int(self._field("llama.attention.head_count_kv", num_heads)),
                head_dim=int(self._field("llama.rope.dimension_count", hidden // num_heads)),
                rope_theta=float(self._field("llama.rope.freq_base", 10000.0)),
                rope_scaling=None,
                rms_eps=float(self._field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
                tie_embeddings="output.weight" not in self.tensors,
                max_position_embeddings=int(self._field("llama.context_length", 4096)),
                bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
                eos_token_ids=tuple(
                    int(t) for t in (self._field("tokenizer.ggml.eos_token_id"),) if t is not None
                ),
            )
        except (TypeError, ValueError) as error:
            raise ModelLoadError(f"{path}: missing or malformed llama metadata ({error})") from None
        config.validate(str(path))
        return config

    def has(self, key: str, layer: int | None = None) -> bool:
        return GGUF_NAMES[key].format(layer) in self.tensors

    def stores_q4(self) -> bool:
        return any(len(t.shape) == 2 and t.ggml_type in Q4_BLOCK_BYTES for t in self.tensors.values())

    def read(
        self, key: str, layer: int | None = None, rows: Range | None = None, cols: Range | None = None
    ) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        tensor = self._tensor(key, layer)
        qtype = GGMLQuantizationType(tensor.ggml_type)
        if len(tensor.shape) == 1:
            return torch.from_numpy(dequantize(tensor.data, qtype).reshape(-1).astype(np.float32))
        data, trailing_cols = self._slice(tensor, rows, cols)
        values = dequantize(np.ascontiguousarray(data), qtype).astype(np.float32, copy=False)
        values = values.reshape(data.shape[0], -1)
        if trailing_cols is not None:
            values = values[:, trailing_cols[0] : trailing_cols[1]]
        if key in ("q", "k"):
            values = values[_rotary_row_order(values.shape[0], self.config.head_dim)]
        if not values.flags.writeable:  # an F32 tensor comes straight from the read-only map
            values = values.copy()
        return torch.from_numpy(np.ascontiguousarray(values))

    def read_q4(
        self, key: str, layer: int | None = None, rows: Range | None = None, cols: Range | None = None
    ) -> Q4Blocks | None:
        """The slice as 4-bit blocks, or None where the tensor is not Q4_0/Q4_1 or the column
        slice would cut a block."""
        tensor = self._tensor(key, layer)
        if tensor.ggml_type not in Q4_BLOCK_BYTES or len(tensor.shape) != 2:
            return None
        data, trailing_cols = self._slice(tensor, rows, cols)
        if trailing_cols is not None:
            return None
        blocks = Q4Blocks.parse(data, tensor.ggml_type)
        if key in ("q", "k"):
            blocks = blocks.take_rows(_rotary_row_order(data.shape[0], self.config.head_dim))
        return blocks

    def _tensor(self, key: str, layer: int | None) -> GGUFTensor:
        name = GGUF_NAMES[key].format(layer)
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.files[0]}: tensor {name} is missing")
        return tensor

    @staticmethod
    def _slice(tensor: GGUFTensor, rows: Range | None, cols: Range | None) -> tuple[np.ndarray, Range | None]:
        """The rows, and the columns where they are whole blocks, as raw data; the column range
        still to cut after dequantizing otherwise."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        _slice_2d(tensor.shape, rows, cols, tensor.name)
        data = tensor.data
        if rows is not None:
            data = data[rows[0] : rows[1]]
        if cols is None:
            return data, None
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.ggml_type)]
        if cols[0] % block or cols[1] % block:
            return data, cols
        # Quantized data is raw bytes per row; F32/F16 come as typed arrays.
        per = block_bytes if data.dtype == np.uint8 else 1
        return data[:, cols[0] // block * per : cols[1] // block * per], None


def _rotary_row_order(rows: int, head_dim: int) -> np.ndarray:
    """Row order that undoes llama.cpp's interleaving of rotary pairs, per head, to the half-split
    layout: row i of the result is row order[i] of the file."""
    heads = rows // head_dim
    return np.arange(rows).reshape(heads, head_dim // 2, 2).swapaxes(1, 2).reshape(rows)


class HFSource:
    """A Hugging Face directory: config.json and one or more *.safetensors files."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        config_path = directory / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{directory}: no config.json in this model directory")
        try:
            raw = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ModelLoadError(f"{config_path}: not valid JSON ({error})") from None
        self.config = config_from_hf(raw, str(config_path))
        self.files = sorted(directory.glob("*.safetensors"))
        if not self.files:
            raise ModelLoadError(f"{directory}: no *.safetensors weight files")
        self.handles = {}
        self.location: dict[str, Path] = {}
        for file in self.files:
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as error:
                raise ModelLoadError(f"{file}: not a readable safetensors file ({error})") from None
            self.handles[file] = handle
            for name in handle.keys():
                self.location[name] = file
        if self.config.tie_embeddings is False and "lm_head.weight" not in self.location:
            raise ModelLoadError(f"{directory}: tie_word_embeddings is false but lm_head.weight is missing")

    def has(self, key: str, layer: int | None = None) -> bool:
        return HF_NAMES[key].format(layer) in self.location

    def stores_q4(self) -> bool:
        return False

    def read(
        self, key: str, layer: int | None = None, rows: Range | None = None, cols: Range | None = None
    ) -> torch.Tensor:
        name = HF_NAMES[key].format(layer)
        file = self.location.get(name)
        if file is None:
            raise ModelLoadError(f"{self.files[0].parent}: tensor {name} is missing")
        view = self.handles[file].get_slice(name)
        shape = tuple(view.get_shape())
        if len(shape) == 1:
            return view[:].float()
        _slice_2d(shape, rows, cols, name)
        r0, r1 = rows if rows is not None else (0, shape[0])
        c0, c1 = cols if cols is not None else (0, shape[1])
        return view[r0:r1, c0:c1].float().contiguous()

    def read_q4(
        self, key: str, layer: int | None = None, rows: Range | None = None, cols: Range | None = None
    ) -> Q4Blocks | None:
        """safetensors checkpoints hold no 4-bit blocks."""
        return None


def open_source(path: str | os.PathLike[str]) -> WeightSource:
    location = Path(path)
    if not location.exists():
        raise ModelLoadError(f"{location}: no such model file or directory")
    if location.is_dir():
        return HFSource(location)
    with location.open("rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{location}: not a GGUF file (magic {magic!r}) nor a model directory")
    return GGUFSource(location)


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


@dataclass
class Phase:
    """Progress of one loading phase: a tqdm bar on a terminal, else one log line at the end."""

    name: str
    total: int
    show_bar: bool

    def __iter__(self) -> Iterator[int]:
        if self.show_bar:
            from tqdm import tqdm

            yield from tqdm(range(self.total), desc=self.name, unit="layer")
        else:
            yield from range(self.total)
            log.info("%s: %d done", self.name, self.total)
