"""Random checkpoints of real shapes, written on the GPU machine where the check runs.

No model file that the check could use fits in what travels to the GPU machine (the embedded GGUF is
98 MB; a Llama-3-8B is 16 GB). So the GPU parts write a Hugging Face directory there, config.json and
*.safetensors of random weights in the layout transformers writes, with SmolLM2's tokenizer
(scripts/device_tokenizer.py, carried in .device/tokenizer) beside them, and the real server loads it
like any checkpoint. What needs real weights is replaced by what random ones can show: greedy
agreement between CUDA graphs and eager on the same model, poison both ways, and fp8 KV against bf16
as a measured agreement rate with a stated floor. Weights are scaled like tests/tiny_models.py's (a
matrix's entries by 1/sqrt(fan-in), norms near 1, embeddings of std 1), so that the logits spread
and greedy choices depend on the computation.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from executor.model.config import ModelConfig
from scripts.device_tokenizer import copy_into


LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rope_scaling=None,
    rms_eps=1e-5,
    tie_embeddings=False,
    max_position_embeddings=8192,
    bos_token_id=1,
    eos_token_ids=(2,),
)
# Small and fast, for correctness; SmolLM2's vocabulary, so every token the tokenizer makes exists.
# (Llama-3-8B's vocabulary is larger than the tokenizer's, and covers all of its ids.)
TINY = replace(LLAMA3_8B, vocab_size=49152, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32)


def parameters(config: ModelConfig) -> int:
    c = config
    attention = c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    layers = c.num_layers * (attention + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size)
    return layers + (1 if c.tie_embeddings else 2) * c.vocab_size * c.hidden_size + c.hidden_size


SHARD_LAYERS = 8  # layers per safetensors file: four files for the 8B shape


def hf_config(config: ModelConfig) -> dict[str, object]:
    """config.json as transformers writes it for a Llama of this shape (untied, no rope scaling)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids[0],
        "torch_dtype": "bfloat16",
    }


def layer_tensors(shape: ModelConfig, layer: int, draw) -> dict[str, torch.Tensor]:  # noqa: ANN001
    s, prefix = shape, f"model.layers.{layer}."
    return {
        prefix + "input_layernorm.weight": draw.norm(s.hidden_size),
        prefix + "post_attention_layernorm.weight": draw.norm(s.hidden_size),
        prefix + "self_attn.q_proj.weight": draw.matrix(s.num_heads * s.head_dim, s.hidden_size),
        prefix + "self_attn.k_proj.weight": draw.matrix(s.num_kv_heads * s.head_dim, s.hidden_size),
        prefix + "self_attn.v_proj.weight": draw.matrix(s.num_kv_heads * s.head_dim, s.hidden_size),
        prefix + "self_attn.o_proj.weight": draw.matrix(s.hidden_size, s.num_heads * s.head_dim),
        prefix + "mlp.gate_proj.weight": draw.matrix(s.intermediate_size, s.hidden_size),
        prefix + "mlp.up_proj.weight": draw.matrix(s.intermediate_size, s.hidden_size),
        prefix + "mlp.down_proj.weight": draw.matrix(s.hidden_size, s.intermediate_size),
    }


class Draw:
    """Seeded random tensors, drawn on `device` (fast on a GPU), stored as `dtype` on the host."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.device, self.dtype = device, dtype
        self.generator = torch.Generator(device).manual_seed(seed)

    def _out(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype).cpu()

    def matrix(self, rows: int, cols: int) -> torch.Tensor:
        return self._out(torch.randn(rows, cols, generator=self.generator, device=self.device) / cols**0.5)

    def norm(self, size: int) -> torch.Tensor:
        return self._out(1.0 + 0.1 * torch.randn(size, generator=self.generator, device=self.device))

    def embedding(self, rows: int, cols: int) -> torch.Tensor:
        return self._out(torch.randn(rows, cols, generator=self.generator, device=self.device))


def write_checkpoint(
    directory: Path, shape: ModelConfig, tokenizer: Path, *, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> Path:
    """config.json, model-NNNNN.safetensors (SHARD_LAYERS layers each) and the tokenizer's files."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(shape), indent=2))
    draw = Draw(device, dtype, seed)
    shards = [range(start, min(start + SHARD_LAYERS, shape.num_layers)) for start in range(0, shape.num_layers, SHARD_LAYERS)]
    for index, layers in enumerate(shards):
        tensors = {}
        if index == 0:
            tensors["model.embed_tokens.weight"] = draw.embedding(shape.vocab_size, shape.hidden_size)
        for layer in layers:
            tensors.update(layer_tensors(shape, layer, draw))
        if index == len(shards) - 1:
            tensors["model.norm.weight"] = draw.norm(shape.hidden_size)
            tensors["lm_head.weight"] = draw.matrix(shape.vocab_size, shape.hidden_size)
        save_file(tensors, str(directory / f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"))
    copy_into(directory, tokenizer)
    return directory
