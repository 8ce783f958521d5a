"""SmolLM2's tokenizer as a small Hugging Face file pair, for the GPU machine.

The embedded GGUF (98 MB) cannot travel to the GPU machine; its tokenizer can. This writes the one
tp_runtime builds from the GGUF's metadata as tokenizer.json and tokenizer_config.json (BOS, EOS,
the chat template), which the device check copies into each random checkpoint it writes there, so
the real server tokenizes real text. scripts/device_wheels.sh runs it:

    python -m scripts.device_tokenizer .device/tokenizer
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tp_runtime.tokenizer import Tokenizer  # noqa: E402

FILES = ("tokenizer.json", "tokenizer_config.json")


def export(source: Path, directory: Path) -> Path:
    tokenizer = Tokenizer.from_model_path(source)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer.to_json())
    config = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "chat_template": tokenizer.chat_template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def copy_into(checkpoint: Path, directory: Path) -> None:
    """Puts the exported tokenizer beside a checkpoint's config.json and weights."""
    for name in FILES:
        (checkpoint / name).write_bytes((directory / name).read_bytes())


def main(argv: list[str]) -> int:
    from executor.model import default_model_path

    export(Path(default_model_path()), Path(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
