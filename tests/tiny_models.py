"""Tiny random Llama checkpoints, for tests that need a real model.

`write_tiny_llama` writes the Hugging Face layout: config.json, model.safetensors, tokenizer.json
(byte-level BPE: three ChatML special tokens and the 256 byte tokens, no merges) and
tokenizer_config.json with a ChatML chat template, so model, executor and server tests can all load
the same directory. `write_tiny_gguf` writes the same kind of model as one GGUF file in llama.cpp's
layout (Q/K rows permuted, matrices in 4-bit blocks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer() -> Tokenizer:
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def write_tiny_llama(
    directory: str | Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 6,
    num_kv_heads: int = 3,
    head_dim: int | None = None,
    tie_embeddings: bool = True,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokens_needed = len(SPECIAL_TOKENS) + 256
    if vocab_size < tokens_needed:
        raise ValueError(f"vocab_size {vocab_size} cannot hold the {tokens_needed} tokenizer tokens")
    head_dim = head_dim or hidden_size // num_heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))

    generator = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) / cols**0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden_size, generator=generator)

    tensors = {
        # Small embeddings keep tied logits from just echoing the input token, so greedy output varies.
        "model.embed_tokens.weight": 0.05 * torch.randn(vocab_size, hidden_size, generator=generator),
        "model.norm.weight": norm(),
    }
    if not tie_embeddings:
        tensors["lm_head.weight"] = matrix(vocab_size, hidden_size)
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = norm()
        tensors[prefix + "post_attention_layernorm.weight"] = norm()
        tensors[prefix + "self_attn.q_proj.weight"] = matrix(num_heads * head_dim, hidden_size)
        tensors[prefix + "self_attn.k_proj.weight"] = matrix(num_kv_heads * head_dim, hidden_size)
        tensors[prefix + "self_attn.v_proj.weight"] = matrix(num_kv_heads * head_dim, hidden_size)
        tensors[prefix + "self_attn.o_proj.weight"] = matrix(hidden_size, num_heads * head_dim)
        tensors[prefix + "mlp.gate_proj.weight"] = matrix(intermediate_size, hidden_size)
        tensors[prefix + "mlp.up_proj.weight"] = matrix(intermediate_size, hidden_size)
        tensors[prefix + "mlp.down_proj.weight"] = matrix(hidden_size, intermediate_size)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))

    _tokenizer().save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return directory


def write_tiny_gguf(
    path: str | Path,
    *,
    qtype: str = "Q4_1",
    vocab_size: int = 320,
    hidden_size: int = 96,
    intermediate_size: int = 192,
    num_layers: int = 2,
    num_heads: int = 6,
    num_kv_heads: int = 3,
    seed: int = 0,
) -> Path:
    """A llama GGUF whose layer matrices are `qtype` blocks (the embedding stays F32, tied).

    Q and K rows are permuted the way llama.cpp's converter does, so a loader that forgot to undo
    it would compute another model."""
    import gguf
    from gguf.quants import quantize

    path = Path(path)
    head_dim = hidden_size // num_heads
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / cols**0.5).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden_size)).astype(np.float32)

    def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(num_layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden_size)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    kind = gguf.GGMLQuantizationType[qtype]

    def add_matrix(name: str, w: np.ndarray) -> None:
        blocks = quantize(w, kind)
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)

    writer.add_tensor("token_embd.weight", 0.05 * rng.standard_normal((vocab_size, hidden_size)).astype(np.float32))
    writer.add_tensor("output_norm.weight", norm())
    for layer in range(num_layers):
        prefix = f"blk.{layer}."
        writer.add_tensor(prefix + "attn_norm.weight", norm())
        writer.add_tensor(prefix + "ffn_norm.weight", norm())
        add_matrix(prefix + "attn_q.weight", llama_cpp_permute(matrix(num_heads * head_dim, hidden_size), num_heads))
        add_matrix(prefix + "attn_k.weight", llama_cpp_permute(matrix(num_kv_heads * head_dim, hidden_size), num_kv_heads))
        add_matrix(prefix + "attn_v.weight", matrix(num_kv_heads * head_dim, hidden_size))
        add_matrix(prefix + "attn_output.weight", matrix(hidden_size, num_heads * head_dim))
        add_matrix(prefix + "ffn_gate.weight", matrix(intermediate_size, hidden_size))
        add_matrix(prefix + "ffn_up.weight", matrix(intermediate_size, hidden_size))
        add_matrix(prefix + "ffn_down.weight", matrix(hidden_size, intermediate_size))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
