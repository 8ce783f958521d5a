"""The tensor-parallel Llama model over the paged KV cache: its weights, and the eager step.

The decoder layer itself is executor/model/decoder.py's; how a step runs (eagerly, compiled layers,
a CUDA graph) is chosen in one place, executor/model/runner.py. This module knows nothing of the
compiled runners: they take the model's weights as `decoder` dataclasses, as the eager loop does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from executor.cache import KVCache
from executor.inputs import StepInputs
from executor.model.attention import AttentionMasks, InvariantAttention, invariant_attention, paged_attention
from executor.model.config import ModelConfig
from executor.model.decoder import AttentionWeights, LayerShape, MlpWeights, StepTensors, attention_block, mlp_block
from executor.model.layers import Linear, Rotary, VocabParallelEmbedding, VocabParallelLMHead, rms_norm
from executor.model.sharding import ShardPlan


@dataclass
class LayerWeights:
    """One decoder layer's local slices, by tensor-parallel role (executor/model/layers.py): QKV
    and gate/up column-parallel and fused (one matmul each; Qwen2's biases are QKV's), o_proj and
    down row-parallel (each all-reduces its partial sum)."""

    attn_norm: torch.Tensor  # float32 [hidden]
    qkv: Linear  # QKVParallelLinear [(local_q + 2 * local_kv) * head_dim, hidden]
    o: Linear  # RowParallelLinear [hidden, local_q * head_dim]
    ffn_norm: torch.Tensor  # float32 [hidden]
    gate_up: Linear  # MergedColumnParallelLinear [2 * local_ffn, hidden]
    down: Linear  # RowParallelLinear [hidden, local_ffn]
    _blocks: dict[tuple[bool, ...], tuple[AttentionWeights, MlpWeights]] = field(default_factory=dict, repr=False)

    @property
    def matrices(self) -> tuple[Linear, Linear, Linear, Linear]:
        return self.qkv, self.o, self.gate_up, self.down

    def blocks(self, rows: int) -> tuple[AttentionWeights, MlpWeights]:
        """The named tensors the decoder blocks read for a call of `rows` rows: each matrix's copy
        for that many rows (int4 or dense, executor.kernels.Matrix)."""
        kinds = tuple(m.uses_int4(rows) for m in self.matrices)
        if kinds not in self._blocks:
            self._blocks[kinds] = (
                AttentionWeights(self.attn_norm, self.qkv.weights_for(rows), self.o.weights_for(rows), self.qkv.bias),
                MlpWeights(self.ffn_norm, self.gate_up.weights_for(rows), self.down.weights_for(rows)),
            )
        return self._blocks[kinds]


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
        deterministic: bool = False,
    ) -> None:
        self.config = config
        self.shard = shard
        self.fingerprint = fingerprint
        self.device = device
        self.layers = layers
        self.final_norm = final_norm
        self.embed = VocabParallelEmbedding(embed, shard)
        self.lm_head = VocabParallelLMHead(lm_head, shard, config.vocab_size, deterministic=deterministic)
        # The deterministic mode (docs/invariance.md): each row's logits independent of its batch
        # mates, its chunking and the TP size; the runner then runs every step eagerly.
        self.deterministic = deterministic
        self.rotary = Rotary(config, device, by_position=deterministic)
        self.ffn_width = shard.ffn[1] - shard.ffn[0]
        # executor.model.compiled: `auto`, `wait` or `off`, read by the runner (runner.py).
        self.compile_mode = compile_mode
        self.shapes = [
            LayerShape(
                hidden=config.hidden_size,
                q_heads=shard.local_q_heads,
                kv_heads=shard.local_kv_heads,
                head_dim=config.head_dim,
                ffn=self.ffn_width,
                rms_eps=config.rms_eps,
                dtype=layers[0].qkv.dtype,
                window=config.layer_window(index),
            )
            for index in range(config.num_layers)
        ]

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].qkv.dtype

    def step_tensors(self, inputs: StepInputs, cache: KVCache) -> StepTensors:
        cos, sin = self.rotary.cos_sin(inputs.positions)
        return StepTensors(cos, sin, inputs.write_pages, inputs.write_offsets, cache.data, cache.scales)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor | None:
        """The eager step: float32 logits [m, vocab] of the sampled rows on rank 0; None elsewhere."""
        x = self.embed(inputs.token_ids)
        return self.logits(self.eager_layers(x, self.step_tensors(inputs, cache), inputs, cache), inputs)

    def logits(self, x: torch.Tensor, inputs: StepInputs) -> torch.Tensor | None:
        """The LM head over the sampled rows of the residual stream after the last layer."""
        if inputs.sample_rows.shape[0] == 0:
            if self.shard.rank != 0:
                return None
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=self.device)
        hidden = rms_norm(x[inputs.sample_rows], self.final_norm, self.config.rms_eps)
        return self.lm_head(hidden)

    def eager_layers(self, x: torch.Tensor, step: StepTensors, inputs: StepInputs, cache: KVCache) -> torch.Tensor:
        """Every decoder layer of the step, eagerly: the decoder blocks with paged attention."""
        rows = inputs.num_tokens
        attends = {shape.window: self._attention(inputs, cache, shape) for shape in self.shapes}
        for index, (layer, shape) in enumerate(zip(self.layers, self.shapes)):
            layer_id, attention = cache.layer_ids[index], attends[shape.window]
            attention_w, mlp_w = layer.blocks(rows)

            def attend(q: torch.Tensor, layer_id: torch.Tensor = layer_id, attention=attention) -> torch.Tensor:  # noqa: ANN001
                return attention(q, layer_id)

            # A calibrating step sets an fp8 cache's scales from the K and V about to be written.
            observe = (lambda k, v, index=index: cache.observe(index, k, v)) if cache.calibrating else None
            x = x + layer.o.reduce(attention_block(shape, x, attention_w, step, layer_id, attend, observe))
            x = x + layer.down.reduce(mlp_block(shape, x, mlp_w))
        return x

    def _attention(
        self, inputs: StepInputs, cache: KVCache, shape: LayerShape
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Attention over the cache for one window (Qwen2 may mix windowed and full layers), its
        masks or plan built once for every layer of the step: q, layer -> [T, Hq * D]."""
        if self.deterministic:
            plan = InvariantAttention.build(
                inputs, shape.q_heads, shape.kv_heads, shape.head_dim, cache.page_size, cache.pad_page, self.device,
                window=shape.window,
            )
            return lambda q, layer: invariant_attention(q, cache.data, layer, cache.scales, plan)
        masks = AttentionMasks.build(
            inputs, shape.q_heads, shape.kv_heads, cache.page_size, self.dtype, self.device, window=shape.window
        )
        return lambda q, layer: paged_attention(q, cache.data, layer, cache.scales, masks)
