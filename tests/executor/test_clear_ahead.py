"""Clearing a step's pages on the link thread once it is handed over (executor/clear_ahead.py): the
memset itself, byte for byte against clear_pages, when the policy lets it run ahead and when not,
and the claim that lets only one of a rank's threads clear a step's pages."""

import logging
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from executor.clear_ahead import ClearAhead, PendingClear
from executor.options import ExecutorOptions
from protocol.frames import KVDtype
from tests.executor.executor_standin import Seq, make_prepare
from tests.executor.test_cache_clear import fill_random, make_cache, raw

PAGES = np.array([0, 3, 4, 5, 9, 11], dtype=np.int32)  # runs of one page and of three, the last page too


@pytest.mark.parametrize("kv_dtype", [d.value for d in KVDtype])
def test_clear_pages_beside_zeroes_what_clear_pages_does_and_nothing_else(kv_dtype):
    ahead, model = make_cache(kv_dtype), make_cache(kv_dtype)
    fill_random(ahead)
    fill_random(model)
    ahead.clear_pages_beside(PAGES)
    model.clear_pages(PAGES)
    assert torch.equal(raw(ahead), raw(model))
    assert bool((raw(ahead)[PAGES] == 0).all())
    untouched = np.setdiff1d(np.arange(ahead.num_kv_pages), PAGES)
    assert bool((raw(ahead)[untouched] != 0).any(dim=tuple(range(1, raw(ahead).dim()))).all())


def test_clear_pages_beside_refuses_a_page_out_of_range_and_clears_nothing():
    cache = make_cache("bf16")
    fill_random(cache)
    before = raw(cache)
    with pytest.raises(IndexError, match="page ids"):
        cache.clear_pages_beside(np.array([2, cache.num_kv_pages], dtype=np.int32))
    assert torch.equal(raw(cache), before)
    cache.clear_pages_beside(np.zeros(0, dtype=np.int32))
    assert torch.equal(raw(cache), before)


def test_clear_pages_beside_is_for_a_cpu_cache_only():
    cache = make_cache("bf16")
    cache.device = torch.device("meta")  # what a CUDA cache reports; its memsets go on its stream
    with pytest.raises(ValueError, match="CPU cache"):
        cache.clear_pages_beside(PAGES)


def options(**overrides) -> ExecutorOptions:
    base = ExecutorOptions(
        model="stand-in", device="cpu", num_kv_pages=12, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64
    )
    return replace(base, **overrides)


def step(cleared=(5,), **lists):
    return make_prepare([Seq(1, (20,), 0, (5,))], cleared=cleared, **lists)


def poisoned_cache():
    cache = make_cache("bf16", num_host_pages=2, poison=True)
    return cache, raw(cache)


def test_a_step_whose_step_before_ran_its_cache_operations_is_cleared_ahead():
    cache, before = poisoned_cache()
    ahead = ClearAhead(cache, options())
    ahead.operated(6)
    assert ahead.clear(7, step(cleared=(5, 6)), PendingClear())
    after = raw(cache)
    assert bool((after[5:7] == 0).all())
    assert torch.equal(after[:5], before[:5]) and torch.equal(after[7:], before[7:])


@pytest.mark.parametrize(
    ("operated", "prepare", "opts", "why"),
    [
        (5, step(), options(), "the step before (6) has not run its cache operations"),
        (-1, step(), options(), "nothing ran yet and this is not the first step"),
        (6, step(offload=((5, 0),)), options(), "its offload comes before its clear"),
        (6, step(restore=((8, 1),)), options(), "its restore comes before its clear"),
        (6, step(poison=(8,)), options(debug_poison_freed=True), "its poison comes before its clear"),
        (6, step(), options(debug_skip_clears=True), "clears are skipped"),
        (6, step(cleared=()), options(), "nothing to clear"),
    ],
)
def test_a_step_is_left_to_the_models_thread_when(operated, prepare, opts, why):
    cache, before = poisoned_cache()
    ahead = ClearAhead(cache, opts)
    ahead.operated(operated)
    assert not ahead.clear(7, prepare, PendingClear()), why
    assert torch.equal(raw(cache), before), why


def test_poison_lists_do_not_hold_a_clear_back_when_poison_is_off():
    cache, _ = poisoned_cache()
    ahead = ClearAhead(cache, options())
    ahead.operated(6)
    assert ahead.clear(7, step(poison=(8,)), PendingClear())
    assert bool((raw(cache)[5] == 0).all())


def test_a_cache_off_the_cpu_is_left_to_the_models_thread():
    cache, _ = poisoned_cache()
    cache.device = torch.device("meta")
    ahead = ClearAhead(cache, options())
    ahead.operated(6)
    assert not ahead.clear(7, step(), PendingClear())


def test_a_clear_that_fails_ahead_is_left_to_the_models_thread(caplog):
    cache, _ = poisoned_cache()
    ahead = ClearAhead(cache, options())
    ahead.operated(6)

    def failing(pages):
        raise RuntimeError("the memset failed")

    cache.clear_pages_beside = failing
    pending = PendingClear()
    with caplog.at_level(logging.ERROR, logger="tp_runtime.executor"):
        assert not ahead.clear(7, step(), pending)
    assert "step 7" in caplog.text and "the memset failed" in caplog.text
    assert pending.claim(lambda: None), "the model's thread still claims the clear"


def test_a_clear_the_models_thread_claimed_is_not_done_again():
    cache, _ = poisoned_cache()
    ahead = ClearAhead(cache, options())
    ahead.operated(6)
    pending = PendingClear()
    assert pending.claim(lambda: cache.clear_pages(np.array([5], dtype=np.int32)))
    cache.poison_pages(np.array([5], dtype=np.int32))  # would be zeroed by a second clear
    assert not ahead.clear(7, step(), pending)
    assert bool((raw(cache)[5] == 0xFF).all())


def test_a_claim_runs_once_and_a_second_waits_for_one_in_progress():
    pending, started, release = PendingClear(), threading.Event(), threading.Event()
    ran: list[str] = []

    def slow() -> None:
        started.set()
        assert release.wait(10)
        ran.append("first")

    first = threading.Thread(target=pending.claim, args=(slow,))
    first.start()
    try:
        assert started.wait(10)
        second: list[bool] = []
        entered = threading.Event()

        def claim_second() -> None:
            entered.set()
            second.append(pending.claim(lambda: ran.append("second")))

        waiter = threading.Thread(target=claim_second)
        waiter.start()
        assert entered.wait(10)
        assert second == [], "the second claim has not returned while the first runs"
    finally:
        release.set()
        first.join(10)
    waiter.join(10)
    assert ran == ["first"] and second == [False]


def test_a_claim_that_raises_leaves_the_clear_to_the_next():
    pending = PendingClear()

    def failing() -> None:
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        pending.claim(failing)
    assert pending.claim(lambda: None)
    assert not pending.claim(lambda: None)
