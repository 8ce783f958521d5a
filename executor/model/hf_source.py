"""Weights from a Hugging Face directory: config.json and *.safetensors, read with
`safe_open(...).get_slice` so that each rank reads only its rows and columns."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from executor.gguf_file import Q4Blocks
from executor.kv_scales import checkpoint_scale_names
from executor.model.config import ModelLoadError, UnsupportedModelError, config_from_hf
from executor.model.source import Range, check_slice, expected_tensors, refuse_unused

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
        check_slice(shape, rows, cols, name)
        r0, r1 = rows if rows is not None else (0, shape[0])
        c0, c1 = cols if cols is not None else (0, shape[1])
        return view[r0:r1, c0:c1].float().contiguous()

    def read_q4(
        self, key: str, layer: int | None = None, rows: Range | None = None, cols: Range | None = None
    ) -> Q4Blocks | None:
        """safetensors checkpoints hold no 4-bit blocks."""
        return None
