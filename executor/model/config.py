"""Llama-family model configuration, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ModelLoadError(Exception):
    """A model file is missing, corrupt, or does not describe a model this runtime can run."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 style frequency-dependent rotary scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_eps: float
    tie_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def validate(self, source: str) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"{source}: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"{source}: {self.num_heads} attention heads do not split into "
                f"{self.num_kv_heads} KV groups"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"{source}: rotary embedding needs an even head_dim, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_scaling_from_hf(raw: dict[str, Any] | None, source: str) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ModelLoadError(f"{source}: rope_scaling type {kind!r} is not supported (only 'llama3')")
    try:
        return RopeScaling(
            factor=float(raw["factor"]),
            low_freq_factor=float(raw["low_freq_factor"]),
            high_freq_factor=float(raw["high_freq_factor"]),
            original_max_position=int(raw["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise ModelLoadError(f"{source}: rope_scaling lacks {missing}") from None


def config_from_hf(raw: dict[str, Any], source: str) -> ModelConfig:
    """Build from config.json keys (LlamaForCausalLM and compatible)."""
    try:
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        config = ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling_from_hf(raw.get("rope_scaling"), source),
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_tuple(raw.get("eos_token_id")),
        )
    except KeyError as missing:
        raise ModelLoadError(f"{source}: config.json lacks the key {missing}") from None
    except (TypeError, ValueError) as bad:
        raise ModelLoadError(f"{source}: config.json has a malformed value: {bad}") from None
    config.validate(source)
    return config
