"""Tiny random Llama checkpoints in the Hugging Face layout, for tests that need a real model.

`write_tiny_llama` writes config.json, model.safetensors, tokenizer.json (byte-level BPE: three
ChatML special tokens and the 256 byte tokens, no merges) and tokenizer_config.json with a ChatML
chat template, so model, executor and server tests can all load the same directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
