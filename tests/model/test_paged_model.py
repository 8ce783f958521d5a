"""The model over the paged cache: reference agreement, chunked prefill, poison, cache dtypes."""

from __future__ import annotations

import pytest
import torch

from executor.model import load_model
from tests.model.driver import Driver
from tests.tiny_models import write_tiny_llama

PROMPT = [5, 70, 33, 99, 100, 101, 7, 250, 12, 13, 14, 400, 3, 77]
CPU = torch.device("cpu")


def _load(directory):
    return load_model(str(directory), rank=0, world_size=1, dtype=torch.float32, device=CPU)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _load(write_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden_size=96))


@pytest.mark.parametrize(
    ("tie", "rope_scaling"),
    [
        (True, None),
        (
            False,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ],
)
def test_matches_transformers_reference(tmp_path, tie, rope_scaling):
    transformers = pytest.importorskip("transformers", reason="transformers is the reference")
    directory = write_tiny_llama(
        tmp_path, hidden_size=96, tie_embeddings=tie, rope_scaling=rope_scaling, seed=3
    )
    model = _load(directory)
    # Positions up to 24 reach past original_max_position (16), where llama3 scaling matters.
    logits, generated = Driver(model, page_size=4).greedy({0: PROMPT}, 10)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT + generated[0]])).logits[0]
    ours = torch.cat(logits)
    start = len(PROMPT) - 1
    torch.testing.assert_close(ours, expected[start : start + ours.shape[0]], atol=1e-4, rtol=1e-4)


def test_chunked_prefill_over_cached_prefix_equals_whole_prefill(tiny):
    whole = Driver(tiny, page_size=4, seed=1)
    expected = whole.step([(0, PROMPT, True)])
    chunked = Driver(tiny, page_size=4, seed=2)
    # Chunks end mid-page and on a page boundary; only the last is sampled.
    assert chunked.step([(0, PROMPT[:5], False)]).shape == (0, tiny.config.vocab_size)
    chunked.step([(0, PROMPT[5:8], False)])
    got = chunked.step([(0, PROMPT[8:], True)])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_mixed_prefill_and_decode_batch_equals_separate_steps(tiny):
    separate = Driver(tiny, page_size=4)
    separate.step([(0, PROMPT[:9], True)])
    decode_alone = separate.step([(0, [42], True)])
    prefill_alone = separate.step([(1, PROMPT[3:], True)])

    mixed = Driver(tiny, page_size=4)
    mixed.step([(0, PROMPT[:9], True)])
    both = mixed.step([(0, [42], True), (1, PROMPT[3:], True)])
    torch.testing.assert_close(both, torch.cat([decode_alone, prefill_alone]), atol=1e-5, rtol=1e-5)


def _poison_run(model, *, poison: bool, clear: bool):
    # Two sequences: ragged lengths leave unwritten slots in each last page.
    driver = Driver(model, page_size=8, poison=poison, clear=clear)
    logits, generated = driver.greedy({0: PROMPT[:5], 1: PROMPT[:11]}, 4)
    return torch.cat(logits), generated


def test_poisoned_cache_with_clears_is_identical_to_unpoisoned(tiny):
    clean, clean_tokens = _poison_run(tiny, poison=False, clear=True)
    poisoned, poisoned_tokens = _poison_run(tiny, poison=True, clear=True)
    assert torch.isfinite(clean).all()
    assert torch.equal(poisoned, clean)
    assert poisoned_tokens == clean_tokens


def test_poisoned_cache_without_clears_gives_non_finite_logits(tiny):
    poisoned, _ = _poison_run(tiny, poison=True, clear=False)
    first_step = poisoned[:2]
    assert not torch.isfinite(first_step).any(dim=-1).any(), "every row reads a stale slot"


def _teacher_forced(driver: Driver) -> torch.Tensor:
    """Prefill most of PROMPT, then decode its remaining tokens one by one."""
    rows = [driver.step([(0, PROMPT[:10], True)])]
    rows += [driver.step([(0, [token], True)]) for token in PROMPT[10:]]
    return torch.cat(rows)


@pytest.mark.parametrize(("kv_dtype", "tolerance"), [("bf16", 0.02), ("fp16", 0.005), ("fp8-e4m3", 0.1)])
def test_reduced_precision_cache_stays_close(tiny, kv_dtype, tolerance):
    reference = _teacher_forced(Driver(tiny, page_size=4))
    got = _teacher_forced(Driver(tiny, page_size=4, kv_dtype=kv_dtype, poison=True))
    assert torch.isfinite(got).all()
    error = (got - reference).abs().max().item()
    assert 0 < error < tolerance * reference.abs().max().item()
