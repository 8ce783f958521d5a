"""Tensor-parallel Llama: `load_model` (load.py) reads this rank's slices and returns a `LlamaModel`
(llama.py), whose decoder layer is decoder.py's; runner.py picks how each step runs."""

from executor.default_model import default_model_path
from executor.model.config import ModelConfig, ModelLoadError
from executor.model.llama import LlamaModel
from executor.model.load import (
    TORCH_DTYPES,
    WEIGHT_FORMATS,
    WeightFormatError,
    load_model,
    open_source,
    resolve_weight_format,
)
from executor.model.sharding import ShardingError, ShardPlan

__all__ = [
    "LlamaModel",
    "ModelConfig",
    "ModelLoadError",
    "ShardPlan",
    "ShardingError",
    "TORCH_DTYPES",
    "WEIGHT_FORMATS",
    "WeightFormatError",
    "default_model_path",
    "load_model",
    "open_source",
    "resolve_weight_format",
]
