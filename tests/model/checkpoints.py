"""Small random checkpoints of each supported architecture, written by transformers itself.

`write_hf` builds the transformers model from its own config class, draws its weights from a seeded
generator (large enough that biases and greedy choices matter) and saves it with save_pretrained,
so the files are what transformers 5 writes. `write_gguf` converts such a model into a GGUF file
the way llama.cpp's convert_hf_to_gguf.py does: Mistral as `llama` (its window as
`llama.attention.sliding_window`), Q/K rows permuted for `llama` (not for `qwen2`), Llama 3.1 rope
scaling as rope_freqs.weight, F32 tensors so that the comparison is exact.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

ARCHITECTURES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Short, so that positions of a few dozen tokens already reach the scaled wavelengths.
    "original_max_position_embeddings": 16,
}


def reference_model(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    import transformers

    fields = {
        "vocab_size": 515,  # odd: the TP LM-head gather pads and trims
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    fields.update(overrides)
    config = getattr(transformers, ARCHITECTURES[model_type])(**fields)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                param.copy_(0.05 * noise if config.tie_word_embeddings else noise)
            else:
                param.copy_(noise / param.shape[1] ** 0.5)
    return model


def write_hf(directory: Path, model: torch.nn.Module) -> Path:
    model.save_pretrained(str(directory))
    return directory


def llama3_rope_factors(config: Any) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it from a llama3 rope scaling."""
    scaling = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (scaling["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(path: Path, model: torch.nn.Module, *, extra: dict[str, np.ndarray] | None = None, metadata: dict[str, Any] | None = None) -> Path:
    """extra: tensors added as they are (for refusal tests); metadata: extra (key, value) fields."""
    import gguf

    config = model.config
    arch = "llama" if config.model_type == "mistral" else config.model_type
    state = {name: tensor.detach().numpy().astype(np.float32) for name, tensor in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if config.model_type == "mistral" and config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)

    def permute(w: np.ndarray, heads: int) -> np.ndarray:
        if arch != "llama":
            return w
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not config.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    if config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    heads = {"q": config.num_attention_heads, "k": config.num_key_value_heads}
    for layer in range(config.num_hidden_layers):
        hf, blk = f"model.layers.{layer}.", f"blk.{layer}."
        writer.add_tensor(blk + "attn_norm.weight", state[hf + "input_layernorm.weight"])
        writer.add_tensor(blk + "ffn_norm.weight", state[hf + "post_attention_layernorm.weight"])
        for short, long in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
            for kind in ("weight", "bias"):
                tensor = state.get(f"{hf}self_attn.{long}.{kind}")
                if tensor is not None:
                    tensor = permute(tensor, heads[short]) if short in heads else tensor
                    writer.add_tensor(f"{blk}attn_{short}.{kind}", tensor)
        writer.add_tensor(blk + "attn_output.weight", state[hf + "self_attn.o_proj.weight"])
        for short in ("gate", "up", "down"):
            writer.add_tensor(f"{blk}ffn_{short}.weight", state[f"{hf}mlp.{short}_proj.weight"])
    for name, tensor in (extra or {}).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 logits of every position of one sequence."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def run_ranks(rank: int, world_size: int, ports: list[int], model_paths: list[str], out_dirs: list[str]) -> None:
    """One spawned rank running tests.model.tp_worker's scenario on several models in turn, so that
    a TP test over every architecture pays for starting its processes once."""
    from tests.model.tp_worker import run_rank

    for port, path, out in zip(ports, model_paths, out_dirs):
        run_rank(rank, world_size, port, path, out, "fp32", "dense")
