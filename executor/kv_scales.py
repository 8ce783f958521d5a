"""Per-layer scales of an FP8 KV cache: where they come from, and how the first step calibrates them.

An fp8-e4m3 cache stores x / scale and reads back stored * scale (vLLM's convention), with one K
scale and one V scale per layer. They come, in this order of `--kv-cache-scales auto`:
1. the checkpoint, where it has them: per layer `model.layers.N.self_attn.k_scale` / `v_scale`, or
   the other spellings vLLM's loaders accept (`.self_attn.k_proj.output_scale` from
   compressed-tensors and Quark, `.self_attn.k_proj.k_scale` from ModelOpt, and the deprecated
   single `.self_attn.kv_scale`, used for both K and V);
2. else calibration: the first step the executor runs (the first prompt's prefill, up to
   --max-num-batched-tokens tokens) measures, per layer, the largest |K| and |V| it writes, and sets
   k_scale to the power of two at or above amax(|K|) / K_RANGE (v_scale likewise with V_RANGE)
   before writing them; the scales are frozen after that step. The ranges are vLLM's
   (`--calculate-kv-scales`, K_SCALE_CONSTANT and V_SCALE_CONSTANT): with the rounding up they
   leave 448 / 200 = 2.2x to 4.5x headroom over the calibrated K, and 4.5x to 9x over V, for later
   tokens. Why a power of two, where vLLM divides exactly: fp8's relative precision is the same
   across its normal range, so what a scale can gain is only to lift small values out of the
   subnormals and to keep large ones from clipping. A power of two does that and nothing else: the
   stored mantissas are those scale 1.0 would store, and reading multiplies by 2^e, exact in every
   dtype. Any other scale re-rounds every value differently, which on the embedded model moved its
   perplexity by -0.3% to +3.6% depending on the scale, noise larger than what the scale buys
   (docs/model.md).
A number (`--kv-cache-scales 0.05`) sets every layer's K and V scale to it; 1.0 is what vLLM uses
without calibration.

Tensor parallelism: each rank holds other KV heads, so the amax of its shard differs from its
peers'. Every rank takes the maximum over all ranks (one all-reduce of two floats per layer, once),
so all ranks store with the scale a single rank holding every head would use: TP=2 quantizes
exactly as TP=1 does, and a checkpoint's per-layer scale (one for all heads) means the same thing at
every TP size.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.errors import TPRuntimeError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

K_RANGE = 200.0
V_RANGE = 100.0
SCALE_SOURCES = ("auto", "checkpoint", "calibrate")
# The smallest scale calibration sets (float32's smallest normal): a layer whose K or V is all zero
# keeps 1.0, and one with tiny values must not divide by a scale that rounds to zero.
MIN_SCALE = 2.0**-126

# Per layer: (K names, V names), each in vLLM's order of preference; `.kv_scale` serves both.
_CHECKPOINT_NAMES = (
    ("model.layers.{}.self_attn.k_scale", "model.layers.{}.self_attn.v_scale"),
    ("model.layers.{}.self_attn.k_proj.output_scale", "model.layers.{}.self_attn.v_proj.output_scale"),
    ("model.layers.{}.self_attn.k_proj.k_scale", "model.layers.{}.self_attn.v_proj.v_scale"),
    ("model.layers.{}.self_attn.kv_scale", "model.layers.{}.self_attn.kv_scale"),
)


def checkpoint_scale_names(num_layers: int) -> set[str]:
    """Every tensor name a checkpoint may hold KV-cache scales under: metadata for the cache, not
    weights of the model, so the loader's check for tensors it would not use leaves them alone."""
    return {name.format(layer) for layer in range(num_layers) for pair in _CHECKPOINT_NAMES for name in pair}


class KVScaleError(TPRuntimeError, ValueError):
    """KV-cache scales that cannot be used: a bad option, or a checkpoint's scales out of shape."""


@dataclass(frozen=True)
class KVScales:
    """One K scale and one V scale per layer, and where they came from (for logs and reports)."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    source: str  # "checkpoint", "flag"

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise KVScaleError(f"{len(self.k)} K scales but {len(self.v)} V scales")
        bad = [s for s in (*self.k, *self.v) if not (math.isfinite(s) and s > 0.0)]
        if bad:
            raise KVScaleError(f"KV cache scales must be finite and positive, got {bad[0]} ({self.source})")

    @classmethod
    def uniform(cls, num_layers: int, value: float, source: str = "flag") -> KVScales:
        return cls((float(value),) * num_layers, (float(value),) * num_layers, source)


def parse_scales_option(text: str) -> str | float:
    """`--kv-cache-scales`: one of SCALE_SOURCES, or a positive number for every layer."""
    if text in SCALE_SOURCES:
        return text
    try:
        value = float(text)
    except ValueError:
        raise KVScaleError(
            f"--kv-cache-scales must be one of {', '.join(SCALE_SOURCES)} or a positive number, got {text!r}"
        ) from None
    if not (math.isfinite(value) and value > 0.0):
        raise KVScaleError(f"--kv-cache-scales must be a finite positive number, got {text!r}")
    return value


def checkpoint_scales(model_path: str | Path, num_layers: int) -> KVScales | None:
    """The K and V scales of a Hugging Face directory's safetensors files, None where it has none.

    GGUF files carry no KV-cache scales (llama.cpp has no such tensor). A checkpoint with scales
    for some layers only, or with per-head scales, is refused: guessing the rest would store
    some layers' K and V with a scale nobody measured."""
    directory = Path(model_path)
    if not directory.is_dir():
        return None
    from safetensors import safe_open

    files: dict[str, Path] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            files.update((name, file) for name in handle.keys() if name.endswith("_scale"))
    k, v, missing = [], [], []
    for layer in range(num_layers):
        found = next(
            ((kn.format(layer), vn.format(layer)) for kn, vn in _CHECKPOINT_NAMES if kn.format(layer) in files),
            None,
        )
        if found is None or found[1] not in files:
            missing.append(layer)
            continue
        k.append(_read_scalar(files[found[0]], found[0]))
        v.append(_read_scalar(files[found[1]], found[1]))
    if len(missing) == num_layers:
        return None
    if missing:
        raise KVScaleError(
            f"{directory}: the checkpoint has KV-cache scales for some layers but not for layers "
            f"{missing[:8]}{'...' if len(missing) > 8 else ''}; use --kv-cache-scales calibrate or a number"
        )
    return KVScales(tuple(k), tuple(v), "checkpoint")


def _read_scalar(file: Path, name: str) -> float:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        tensor = handle.get_tensor(name)
    if tensor.numel() != 1:
        raise KVScaleError(
            f"{file}: {name} has shape {tuple(tensor.shape)}: only per-tensor KV-cache scales (one value "
            "per layer) are supported, not per-head ones"
        )
    return float(tensor.float().item())


def resolve_scales(option: str | float, checkpoint: KVScales | None, num_layers: int) -> KVScales | None:
    """The scales a cache starts with; None: calibrate them on the first step."""
    if isinstance(option, float):
        return KVScales.uniform(num_layers, option)
    if option == "checkpoint":
        if checkpoint is None:
            raise KVScaleError(
                "--kv-cache-scales checkpoint: the model has no KV-cache scales (k_scale / v_scale "
                "tensors); use auto to calibrate them instead"
            )
        return checkpoint
    if option == "calibrate":
        return None
    return checkpoint


def cache_scales(
    option: str, model_path: str | Path, num_layers: int, world_size: int, kv_dtype: str
) -> KVScales | ScaleCalibration | None:
    """What a rank's KVCache is built with for `--kv-cache-scales option`: None unless fp8."""
    if kv_dtype != "fp8-e4m3":
        return None
    scales = resolve_scales(parse_scales_option(option), checkpoint_scales(model_path, num_layers), num_layers)
    if scales is None:
        return ScaleCalibration(num_layers, world_size)
    log.info("KV cache scales from the %s", scales.source)
    return scales


class ScaleCalibration:
    """Sets each layer's scales from the first K and V written to it while armed, then is done.

    `observe` runs in the forward, once per layer and in layer order on every rank, so every rank
    joins the same all-reduces in the same order. (This module imports torch only here: the CLI
    parses --kv-cache-scales without it.)"""

    def __init__(self, num_layers: int, world_size: int = 1) -> None:
        self.num_layers = num_layers
        self.world_size = world_size
        self.calibrated = 0  # layers done, in order

    @property
    def done(self) -> bool:
        return self.calibrated == self.num_layers

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor) -> None:
        """Set scales[layer] ([2]: K, V, on the cache's device) from this step's k and v of that layer."""
        import torch

        if k.numel() == 0:
            return
        if layer != self.calibrated:
            raise RuntimeError(f"calibration expected layer {self.calibrated}, got {layer}")
        amax = torch.stack((k.detach().abs().amax(), v.detach().abs().amax())).float()
        # A NaN or inf (only where something upstream already failed) must not become a scale, and
        # must not make the ranks disagree: it counts as nothing measured.
        amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
        if self.world_size > 1:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
        ranges = torch.tensor((K_RANGE, V_RANGE), device=amax.device)
        power_of_two = torch.exp2(torch.ceil(torch.log2(amax / ranges))).clamp_min(MIN_SCALE)
        scales[layer].copy_(torch.where(amax > 0, power_of_two, torch.ones_like(amax)))
        self.calibrated += 1
        if self.done:
            values = scales.tolist()
            log.info(
                "KV cache scales calibrated on the first step: K %.3g..%.3g, V %.3g..%.3g over %d layers",
                min(s[0] for s in values), max(s[0] for s in values),
                min(s[1] for s in values), max(s[1] for s in values), len(values),
            )

