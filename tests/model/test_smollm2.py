"""The embedded SmolLM2-135M-Instruct GGUF against transformers' independent loading of it.

transformers dequantizes the same GGUF and runs its own Llama; our loader un-permutes llama.cpp's
Q/K rows and runs the paged forward. Both in fp32: the logits agree to float rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor.model import ModelLoadError, default_model_path, load_model
from tests.model.driver import Driver
from tp_runtime.chat import render_chat
from tp_runtime.tokenizer import Tokenizer

try:
    MODEL_PATH = Path(default_model_path())
except ModelLoadError as missing:
    pytest.skip(str(missing), allow_module_level=True)
transformers = pytest.importorskip(
    "transformers", reason="transformers (with accelerate) is the reference implementation"
)
pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")

# Logits are O(10-40); fp32 dequantized weights on both sides leave only summation-order noise.
LOGIT_ATOL = 2e-3
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village",
]
QUESTION = "What is 2+2?"
ANSWER = "The answer to this classic math problem is 4."


# transformers reads the GGUF header (49k-token vocabulary) slowly for its reference model; the
# runtime's tokenizer reads it fast and builds the same ids (tests/server checks that).
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_model_path(MODEL_PATH)


@pytest.fixture(scope="module")
def reference():
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(MODEL_PATH.parent), gguf_file=MODEL_PATH.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def model():
    return load_model(
        str(MODEL_PATH), rank=0, world_size=1, dtype=torch.float32, device=torch.device("cpu")
    )


def test_config_read_from_gguf(model):
    config = model.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.rope_theta, config.tie_embeddings) == (49152, 100000.0, True)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_last_token_logits_match_reference(model, reference, tokenizer):
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    # All prompts in one batched prefill step of ours; one forward each for the reference.
    ours = Driver(model, num_kv_pages=32, page_size=16).step(
        [(index, ids, True) for index, ids in enumerate(prompts)]
    )
    with torch.no_grad():
        expected = torch.stack([reference(torch.tensor([ids])).logits[0, -1] for ids in prompts])
    torch.testing.assert_close(ours, expected, atol=LOGIT_ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_greedy_chat_answer_matches_reference(model, reference, tokenizer):
    text = render_chat(tokenizer, [{"role": "user", "content": QUESTION}])
    prompt = tokenizer.encode(text, add_special_tokens=False)
    answer_len = len(tokenizer.encode(ANSWER, add_special_tokens=False)) + 1  # and <|im_end|>
    logits, generated = Driver(model, num_kv_pages=32, page_size=16).greedy({0: prompt}, answer_len - 1)
    tokens = generated[0] + [int(logits[-1].argmax())]
    assert tokens[-1] in model.config.eos_token_ids
    assert tokenizer.decode(tokens) == ANSWER

    # The reference, teacher-forced on our continuation, picks the same token at every step:
    # that is the same greedy continuation, checked with one reference forward.
    with torch.no_grad():
        expected = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    assert expected.argmax(-1).tolist() == tokens
    torch.testing.assert_close(torch.cat(logits), expected, atol=LOGIT_ATOL, rtol=0)
