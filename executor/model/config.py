"""Model configuration, read from a Hugging Face config.json or GGUF metadata.

This runtime computes one decoder: RMSNorm, rotary attention with grouped KV heads, a SiLU-gated
MLP. Llama, Mistral and Qwen2 checkpoints are that decoder with a few switches (q/k/v biases, a
sliding attention window, llama3 rotary scaling); anything that asks for more is refused here by
name, because loading it as Llama would run and give wrong text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from executor.errors import ModelLoadError


class UnsupportedModelError(ModelLoadError):
    """A well-formed checkpoint of an architecture, or with a feature, this runtime does not run
    exactly (an unknown architecture, a rotary scaling it does not implement, MoE, biases where it
    has none)."""


# Hugging Face's class name -> model_type: the decoders this runtime computes exactly.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
ROPE_TYPES = ("default", "llama3")


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
    architecture: str = "llama"
    qkv_bias: bool = False  # Qwen2: q, k and v projections have biases (o_proj has none)
    # A query sees the last `sliding_window` positions, itself included (Hugging Face's
    # kv_idx > q_idx - window), in the layers listed; None: every layer attends to all of its past.
    sliding_window: int | None = None
    windowed_layers: tuple[int, ...] = ()
    # GGUF's rope_freqs.weight (Llama 3.1): rotary frequency i is divided by factor i.
    rope_freq_factors: tuple[float, ...] | None = None

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
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ModelLoadError(f"{source}: sliding_window must be positive, got {self.sliding_window}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ModelLoadError(
                f"{source}: {len(self.rope_freq_factors)} rotary frequency factors for a head_dim of "
                f"{self.head_dim} (it needs {self.head_dim // 2})"
            )

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def layer_window(self, layer: int) -> int | None:
        """The attention window of one layer; None where it attends to its whole past."""
        return self.sliding_window if layer in self.windowed_layers else None


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_from_hf(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling: transformers 5 writes both into `rope_parameters`, checkpoints
    saved before it have a top-level `rope_theta` and `rope_scaling`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"{source}: rope_parameters must be an object, got {params!r}")
    if any(isinstance(value, dict) for value in params.values()):
        raise UnsupportedModelError(f"{source}: rotary parameters per layer type are not supported")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor {partial} is not supported (only 1.0)")
    if kind == "default":
        return theta, None
    try:
        return theta, RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(
                raw.get("original_max_position_embeddings") or params["original_max_position_embeddings"]
            ),
        )
    except KeyError as missing:
        raise ModelLoadError(f"{source}: llama3 rope scaling lacks {missing}") from None


def hf_model_type(raw: dict[str, Any], source: str) -> str:
    """The model_type of a config.json that this runtime runs, or UnsupportedModelError."""
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list):
        raise ModelLoadError(f"{source}: architectures must be a list, got {architectures!r}")
    supported = ", ".join(HF_ARCHITECTURES)
    if len(architectures) > 1:
        raise UnsupportedModelError(f"{source}: several architectures {architectures}; expected one of {supported}")
    if architectures:
        if architectures[0] not in HF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: architecture {architectures[0]!r} is not supported (supported: {supported})"
            )
        expected = HF_ARCHITECTURES[architectures[0]]
        if model_type is not None and model_type != expected:
            raise UnsupportedModelError(
                f"{source}: architecture {architectures[0]} has model_type {expected!r}, but the config says {model_type!r}"
            )
        return expected
    if model_type is None:
        raise UnsupportedModelError(f"{source}: names neither architectures nor model_type; expected one of {supported}")
    if model_type not in HF_ARCHITECTURES.values():
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported (supported: "
            f"{', '.join(HF_ARCHITECTURES.values())})"
        )
    return model_type


def _refuse_features(raw: dict[str, Any], model_type: str, source: str) -> None:
    """Switches transformers honours that this runtime would silently ignore."""
    activation = raw.get("hidden_act", "silu")
    if activation != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {activation!r} is not supported (only 'silu')")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise UnsupportedModelError(
            f"{source}: quantized checkpoints ({method}) are not supported; use the unquantized weights or a GGUF file"
        )
    if model_type == "llama":
        for flag in ("attention_bias", "mlp_bias"):
            if raw.get(flag):
                raise UnsupportedModelError(f"{source}: Llama with {flag} true is not supported")
        if int(raw.get("pretraining_tp") or 1) != 1:
            raise UnsupportedModelError(f"{source}: pretraining_tp {raw['pretraining_tp']} is not supported (only 1)")


def _window_from_hf(raw: dict[str, Any], model_type: str, num_layers: int, source: str) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window and the layers it applies to, the way transformers reads them."""
    if model_type == "mistral":
        # MistralModel applies config.sliding_window to every layer and ignores layer_types.
        window = raw.get("sliding_window", 4096)
        return (None, ()) if window is None else (int(window), tuple(range(num_layers)))
    if model_type == "qwen2":
        if not raw.get("use_sliding_window", False) or raw.get("sliding_window", 4096) is None:
            return None, ()
        window = int(raw.get("sliding_window", 4096))
        types = raw.get("layer_types") or [
            "sliding_attention" if i >= int(raw.get("max_window_layers", 28)) else "full_attention"
            for i in range(num_layers)
        ]
        if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
            raise ModelLoadError(f"{source}: layer_types must name full_attention or sliding_attention for each of {num_layers} layers")
        layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
        return (window, layers) if layers else (None, ())
    return None, ()


def config_from_hf(raw: dict[str, Any], source: str) -> ModelConfig:
    """Build from config.json keys (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)."""
    model_type = hf_model_type(raw, source)
    _refuse_features(raw, model_type, source)
    try:
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        num_layers = int(raw["num_hidden_layers"])
        rope_theta, rope_scaling = _rope_from_hf(raw, source)
        window, windowed = _window_from_hf(raw, model_type, num_layers, source)
        config = ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_tuple(raw.get("eos_token_id")),
            architecture=model_type,
            qkv_bias=model_type == "qwen2",
            sliding_window=window,
            windowed_layers=windowed,
        )
    except KeyError as missing:
        raise ModelLoadError(f"{source}: config.json lacks the key {missing}") from None
    except (TypeError, ValueError) as bad:
        raise ModelLoadError(f"{source}: config.json has a malformed value: {bad}") from None
    config.validate(source)
    return config
