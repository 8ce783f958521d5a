"""Weights from a GGUF file (llama.cpp's converter layout): llama and qwen2.

Quantized tensors are sliced before they are dequantized: their blocks run along the input
dimension, so whole output rows (and block-aligned input columns) are byte ranges of the file. Q and
K rows of `llama` files are un-permuted per head to the half-split rotary layout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from executor.gguf_file import Q4_BLOCK_BYTES, GGUFFile, GGUFFormatError, GGUFTensor, Q4Blocks
from executor.model.config import ModelConfig, ModelLoadError, UnsupportedModelError
from executor.model.source import Range, check_slice, expected_tensors, refuse_unused

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
    "q_bias": "blk.{}.attn_q.bias",
    "k_bias": "blk.{}.attn_k.bias",
    "v_bias": "blk.{}.attn_v.bias",
}
# GGUF architectures this runtime runs; llama.cpp permutes Q/K rows of `llama` only (its rotary
# is interleaved there and half-split, as in Hugging Face, for qwen2).
GGUF_ARCHITECTURES = ("llama", "qwen2")


class GGUFSource:
    """A llama or qwen2 GGUF file (llama.cpp's converter layout)."""

    def __init__(self, path: Path) -> None:
        self.files = [path]
        try:
            self.file = GGUFFile(path)
        except (GGUFFormatError, OSError, ValueError) as error:
            raise ModelLoadError(f"{path}: not a readable GGUF file ({error})") from None
        self.tensors = self.file.tensors
        self.config = self._config(path)
        refuse_unused(str(path), set(self.tensors) - {"rope_freqs.weight"}, expected_tensors(GGUF_NAMES, self.config), self.config)

    def _field(self, key: str, default: object = None) -> object:
        return self.file.metadata.get(key, default)

    def _config(self, path: Path) -> ModelConfig:
        arch = self._field("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})"
            )
        self.arch = str(arch)
        self._refuse_features(path)

        def field(key: str, default: object = None) -> object:
            return self._field(f"{arch}.{key}", default)

        try:
            num_heads = int(field("attention.head_count"))
            hidden = int(field("embedding_length"))
            head_dim = int(field("rope.dimension_count", hidden // num_heads))
            vocab = field("vocab_size") or len(self._field("tokenizer.ggml.tokens", []))
            window = field("attention.sliding_window")
            num_layers = int(field("block_count"))
            config = ModelConfig(
                vocab_size=int(vocab),
                hidden_size=hidden,
                intermediate_size=int(field("feed_forward_length")),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(field("attention.head_count_kv", num_heads)),
                head_dim=head_dim,
                rope_theta=float(field("rope.freq_base", 10000.0)),
                rope_scaling=None,
                rms_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
                tie_embeddings="output.weight" not in self.tensors,
                max_position_embeddings=int(field("context_length", 4096)),
                bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
                eos_token_ids=tuple(
                    int(t) for t in (self._field("tokenizer.ggml.eos_token_id"),) if t is not None
                ),
                architecture=self.arch,
                qkv_bias=self.arch == "qwen2",
                sliding_window=None if window is None else int(window),
                windowed_layers=() if window is None else tuple(range(num_layers)),
                rope_freq_factors=self._rope_freq_factors(),
            )
        except (TypeError, ValueError) as error:
            raise ModelLoadError(f"{path}: missing or malformed {arch} metadata ({error})") from None
        config.validate(str(path))
        return config

    def _refuse_features(self, path: Path) -> None:
        """Metadata llama.cpp would act on and this runtime would not."""
        experts = self._field(f"{self.arch}.expert_count") or 0
        if int(experts) > 0:
            raise UnsupportedModelError(f"{path}: mixture-of-experts models ({experts} experts) are not supported")
        # llama.cpp reads a scaling factor without a type as linear scaling.
        kind = self._field(f"{self.arch}.rope.scaling.type", "linear")
        factor = float(self._field(f"{self.arch}.rope.scaling.factor", 0.0))
        if kind != "none" and factor not in (0.0, 1.0):
            raise UnsupportedModelError(
                f"{path}: rope scaling {kind!r} (factor {factor}) is not supported; Llama 3.1 "
                "frequency factors (rope_freqs.weight) are"
            )

    def _rope_freq_factors(self) -> tuple[float, ...] | None:
        tensor = self.tensors.get("rope_freqs.weight")
        if tensor is None:
            return None
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return tuple(float(f) for f in dequantize(tensor.data, GGMLQuantizationType(tensor.ggml_type)).reshape(-1))

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
            values = dequantize(tensor.data, qtype).reshape(-1).astype(np.float32)
            return torch.from_numpy(values[slice(*rows) if rows else slice(None)].copy())
        data, trailing_cols = self._slice(tensor, rows, cols)
        values = dequantize(np.ascontiguousarray(data), qtype).astype(np.float32, copy=False)
        values = values.reshape(data.shape[0], -1)
        if trailing_cols is not None:
            values = values[:, trailing_cols[0] : trailing_cols[1]]
        if key in ("q", "k") and self.arch == "llama":
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
        if key in ("q", "k") and self.arch == "llama":
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

        check_slice(tensor.shape, rows, cols, tensor.name)
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
