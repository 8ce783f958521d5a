"""`tp-runtime generate` with the embedded default model gives the reference's greedy text."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Greedy, chat-formatted, from transformers loading the same GGUF (shared/FACTS.md; the model tests
# check our logits against that reference directly).
REFERENCE = {"What is 2+2?": "The answer to this classic math problem is 4."}


@pytest.mark.parametrize("tp", [1, 2])
def test_generate_matches_the_reference(tp: int) -> None:
    prompt, expected = next(iter(REFERENCE.items()))
    result = subprocess.run(
        [sys.executable, "-m", "tp_runtime", "generate", prompt, "--max-tokens", "24", "--tensor-parallel-size", str(tp),
         "--kv-cache-memory", "64MiB", "--max-model-len", "512"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == expected, result.stdout
