"""TP=2 over gloo against TP=1 on tiny random models, including uneven and replicated KV heads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from executor.model import load_model
from tests.model.tp_worker import run_tp, scenario
from tests.tiny_models import write_tiny_llama

# fp32 everywhere; TP changes only the summation order of the all-reduces.
ATOL = 1e-4
RTOL = 1e-4


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "tie"),
    [
        (6, 3, True),  # 3 KV groups over 2 ranks: 2 + 1, query heads 4 + 2
        (4, 1, False),  # 1 KV head over 2 ranks: replicated, query heads 2 + 2; separate LM head
    ],
)
def test_tp2_matches_tp1(tmp_path, num_heads, num_kv_heads, tie):
    model_dir = write_tiny_llama(
        tmp_path / "model",
        hidden_size=96,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        tie_embeddings=tie,
        vocab_size=515,  # not divisible by 2: the LM-head gather pads and trims
    )
    single = load_model(
        str(model_dir), rank=0, world_size=1, dtype=torch.float32, device=torch.device("cpu")
    )
    expected_logits, expected_tokens = scenario(single)

    out = tmp_path / "out"
    out.mkdir()
    run_tp(model_dir, out, world_size=2)

    logits = np.load(out / "logits.npy")
    generated = {int(k): v for k, v in json.loads((out / "generated.json").read_text()).items()}
    expected = torch.cat(expected_logits).numpy()
    assert logits.shape == expected.shape == (2 * len(expected_logits), 515)
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=RTOL)
    assert generated == expected_tokens
    assert len(set(sum(expected_tokens.values(), []))) > 2, "greedy output should not be degenerate"

    fingerprints = {(out / f"fingerprint{rank}.txt").read_text() for rank in range(2)}
    assert len(fingerprints) == 1, "every rank must report the same fingerprint"
    assert fingerprints != {single.fingerprint}, "the fingerprint includes the world size"
