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

from executor.model.config import ModelConfig, ModelLoadError, UnsupportedModelError, config_from_hf
from executor.gguf_file import Q4_BLOCK_BYTES, GGUFFile, GGUFFormatError, GGUFTensor, Q4Blocks
from executor.kv_scales import checkpoint_scale_names

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
    "q_bias": "blk.{}.attn_q.bias",
    "k_bias": "blk.{}.attn_k.bias",
    "v_bias": "blk.{}.attn_v.bias",
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
    "q_bias": "model.layers.{}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{}.self_attn.v_proj.bias",
}
GLOBAL_KEYS = ("embed", "final_norm", "lm_head")
BIAS_KEYS = ("q_bias", "k_bias", "v_bias")
# GGUF architectures this runtime runs; llama.cpp permutes Q/K rows of `llama` only (its rotary
# is interleaved there and half-split, as in Hugging Face, for qwen2).
GGUF_ARCHITECTURES = ("llama", "qwen2")


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


def _slice_2d(shape: tuple[int, ...], rows: Range | None, cols: Range | None, name: str) -> None:
    for axis, span in ((0, rows), (1, cols)):
        if span is not None and not 0 <= span[0] <= span[1] <= shape[axis]:
            raise ModelLoadError(f"{name}: slice {span} is outside dimension {axis} of shape {shape}")


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
        # Checkpoints of models trained with rotary caches sometimes saved them; they are derived.
        present = {name for name in self.location if not name.endswith("rotary_emb.inv_freq")}
        present -= checkpoint_scale_names(self.config.num_layers)
        refuse_unused(str(directory), present, expected_tensors(HF_NAMES, self.config), self.config)
        self._check_tying(directory)

    def _check_tying(self, directory: Path) -> None:
        """The config's tie_word_embeddings must agree with the weights: untied with no lm_head would
        leave the head random in transformers, tied with a different lm_head is two models at once."""
        has_head = HF_NAMES["lm_head"] in self.location
        if not self.config.tie_embeddings and not has_head:
            raise ModelLoadError(f"{directory}: tie_word_embeddings is false but lm_head.weight is missing")
        if self.config.tie_embeddings and has_head:
            # Evenly spaced rows tell a copy of the embedding from another matrix, without reading both.
            rows = sorted({self.config.vocab_size * i // 8 for i in range(8)})
            embed, head = (self.handles[self.location[HF_NAMES[k]]].get_slice(HF_NAMES[k]) for k in ("embed", "lm_head"))
            if not all(torch.equal(embed[r : r + 1], head[r : r + 1]) for r in rows):
                raise UnsupportedModelError(
                    f"{directory}: tie_word_embeddings is true but lm_head.weight differs from the "
                    "embedding; set it to false in config.json to use the separate head"
                )

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
            return view[slice(*rows) if rows else slice(None)].float()
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
