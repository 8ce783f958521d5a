"""The tensor-parallel Llama forward over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor.cache import KVCache
from executor.inputs import StepInputs
from executor.model.attention import AttentionMasks, paged_attention
from executor.model.config import ModelConfig
from executor.model.layers import (
    Rotary,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    all_reduce,
    Linear,
    rms_norm,
)
from executor.model.sharding import ShardPlan


@dataclass
class LayerWeights:
    """One decoder layer's local slices. QKV and gate/up are fused: one matmul each."""

    attn_norm: torch.Tensor  # float32 [hidden]
    qkv: Linear  # [(local_q + 2 * local_kv) * head_dim, hidden]
    o: Linear  # [hidden, local_q * head_dim]
    ffn_norm: torch.Tensor  # float32 [hidden]
    gate_up: Linear  # [2 * local_ffn, hidden]
    down: Linear  # [hidden, local_ffn]


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        shard: ShardPlan,
        *,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        final_norm: torch.Tensor,
        layers: list[LayerWeights],
        fingerprint: str,
        device: torch.device,
    ) -> None:
        self.config = config
        self.shard = shard
        self.fingerprint = fingerprint
        self.device = device
        self.layers = layers
        self.final_norm = final_norm
        self.embed = VocabParallelEmbedding(embed, shard)
        self.lm_head = VocabParallelLMHead(lm_head, shard, config.vocab_size)
        self.rotary = Rotary(config, device)
        head_dim = config.head_dim
        self.q_width = shard.local_q_heads * head_dim
        self.kv_width = shard.local_kv_heads * head_dim
        self.ffn_width = shard.ffn[1] - shard.ffn[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].qkv.dtype

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor | None:
        """Float32 logits [m, vocab] of the sampled rows on rank 0; None on the other ranks."""
        config, world = self.config, self.shard.world_size
        head_dim, tokens = config.head_dim, inputs.num_tokens
        x = self.embed(inputs.token_ids)
        q_heads, kv_heads = self.shard.local_q_heads, self.shard.local_kv_heads
        qk_width = self.q_width + self.kv_width
        cos, sin = self.rotary.cos_sin(inputs.positions)
        masks = AttentionMasks.build(
            inputs, q_heads, kv_heads, cache.page_size, self.dtype, self.device
        )
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, config.rms_eps)
            qkv = layer.qkv(h)
            qk = qkv[:, :qk_width].view(tokens, q_heads + kv_heads, head_dim)
            qk = Rotary.apply(qk, cos, sin)
            q, k = qk.split([q_heads, kv_heads], dim=1)
            v = qkv[:, qk_width:].view(tokens, kv_heads, head_dim)
            cache.write(index, inputs.write_pages, inputs.write_offsets, k, v)
            k_cache, v_cache = cache.key_value(index)
            attended = paged_attention(q, k_cache, v_cache, inputs, masks, kv_scale=cache.scale)
            x = x + all_reduce(layer.o(attended).float(), world)
            h = rms_norm(x, layer.ffn_norm, config.rms_eps)
            gate, up = layer.gate_up(h).split(self.ffn_width, dim=-1)
            x = x + all_reduce(layer.down(F.silu(gate) * up).float(), world)
        if inputs.sample_rows.shape[0] == 0:
            if self.shard.rank != 0:
                return None
            return torch.empty(0, config.vocab_size, dtype=torch.float32, device=self.device)
        hidden = rms_norm(x[inputs.sample_rows], self.final_norm, config.rms_eps)
        return self.lm_head(hidden)
