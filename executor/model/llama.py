"""The tensor-parallel Llama forward over the paged KV cache."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor.cache import KVCache
from executor.inputs import StepInputs
from executor.model.attention import AttentionMasks, paged_attention
from executor.model.compiled import CompiledDecode
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

log = logging.getLogger(__name__)


@dataclass
class LayerWeights:
    """One decoder layer's local slices. QKV and gate/up are fused: one matmul each."""

    attn_norm: torch.Tensor  # float32 [hidden]
    qkv: Linear  # [(local_q + 2 * local_kv) * head_dim, hidden]
    o: Linear  # [hidden, local_q * head_dim]
    ffn_norm: torch.Tensor  # float32 [hidden]
    gate_up: Linear  # [2 * local_ffn, hidden]
    down: Linear  # [hidden, local_ffn]
    qkv_bias: torch.Tensor | None = None  # [(local_q + 2 * local_kv) * head_dim]: Qwen2's q/k/v biases


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
        compile_mode: str = "off",
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
        # executor.model.compiled: `auto`, `wait` or `off`; the libraries depend on the cache's
        # geometry, so they are attached at the first decode step over a cache of a new geometry.
        if compile_mode != "off" and (config.qkv_bias or config.sliding_window is not None):
            log.info(
                "%s decodes eager: the compiled decode layers have no q/k/v biases and no attention window",
                config.architecture,
            )
            compile_mode = "off"
        self.compile_mode = compile_mode
        self._compiled: dict[tuple, CompiledDecode | None] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].qkv.dtype

    def compiled_decode(self, cache: KVCache) -> CompiledDecode | None:
        """The compiled decode layers for this cache's geometry, attached on first use."""
        geometry = (cache.page_size, cache.storage_dtype, cache.num_layers)
        if geometry not in self._compiled:
            self._compiled[geometry] = CompiledDecode.attach(self, cache, self.compile_mode)
        return self._compiled[geometry]

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor | None:
        """Float32 logits [m, vocab] of the sampled rows on rank 0; None on the other ranks."""
        config = self.config
        x = self.embed(inputs.token_ids)
        cos, sin = self.rotary.cos_sin(inputs.positions)
        # A calibrating step writes K and V through the cache, which sets the scales as it goes.
        compiled = self.compiled_decode(cache) if inputs.is_decode and not cache.calibrating else None
        if compiled is not None and compiled.covers(inputs.num_tokens):
            x = compiled.run(x, cos, sin, inputs, cache)
        elif compiled is not None:
            begin = time.perf_counter()
            x = self._layers(x, cos, sin, inputs, cache)
            compiled.eager_decoded(time.perf_counter() - begin)
        else:
            x = self._layers(x, cos, sin, inputs, cache)
        if inputs.sample_rows.shape[0] == 0:
            if self.shard.rank != 0:
                return None
            return torch.empty(0, config.vocab_size, dtype=torch.float32, device=self.device)
        hidden = rms_norm(x[inputs.sample_rows], self.final_norm, config.rms_eps)
        return self.lm_head(hidden)

    def _layers(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inputs: StepInputs, cache: KVCache
    ) -> torch.Tensor:
        """Every decoder layer, eager: prefill and mixed steps, and decode without compiled layers."""
        config, world = self.config, self.shard.world_size
        head_dim, tokens = config.head_dim, inputs.num_tokens
        q_heads, kv_heads = self.shard.local_q_heads, self.shard.local_kv_heads
        qk_width = self.q_width + self.kv_width
        # One set of masks per distinct window (Qwen2 may mix windowed and full layers).
        windows = [config.layer_window(index) for index in range(config.num_layers)]
        masks_of = {
            window: AttentionMasks.build(
                inputs, q_heads, kv_heads, cache.page_size, self.dtype, self.device, window=window
            )
            for window in dict.fromkeys(windows)
        }
        for index, layer in enumerate(self.layers):
            masks = masks_of[windows[index]]
            h = rms_norm(x, layer.attn_norm, config.rms_eps)
            qkv = layer.qkv(h)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            qk = qkv[:, :qk_width].view(tokens, q_heads + kv_heads, head_dim)
            qk = Rotary.apply(qk, cos, sin)
            q, k = qk.split([q_heads, kv_heads], dim=1)
            v = qkv[:, qk_width:].view(tokens, kv_heads, head_dim)
            cache.write(index, inputs.write_pages, inputs.write_offsets, k, v)
            k_cache, v_cache = cache.key_value(index)
            k_scale, v_scale = cache.layer_scales(index)
            attended = paged_attention(q, k_cache, v_cache, inputs, masks, k_scale=k_scale, v_scale=v_scale)
            x = x + all_reduce(layer.o(attended).float(), world)
            h = rms_norm(x, layer.ffn_norm, config.rms_eps)
            gate, up = layer.gate_up(h).split(self.ffn_width, dim=-1)
            x = x + all_reduce(layer.down(F.silu(gate) * up).float(), world)
        return x
