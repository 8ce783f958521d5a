"""clear_pages, poison and host offload on the CPU, for every KV cache dtype, checked byte for byte."""

import numpy as np
import pytest
import torch

from executor.cache import KVCache
from protocol.frames import KVDtype

NUM_PAGES = 12
PAGE_SIZE = 4
LAYERS = 3
HEADS = 2
HEAD_DIM = 8


def make_cache(kv_dtype: str, num_host_pages: int = 0, poison: bool = False) -> KVCache:
    return KVCache(
        num_kv_pages=NUM_PAGES,
        page_size=PAGE_SIZE,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        kv_dtype=kv_dtype,
        device=torch.device("cpu"),
        num_host_pages=num_host_pages,
        poison=poison,
    )


def fill_random(cache: KVCache, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(cache.data.shape, generator=g).clamp(-4, 4)
    cache.data.copy_(values.to(cache.storage_dtype))
    cache.data[cache.pad_page].zero_()


def raw(cache: KVCache) -> torch.Tensor:
    return cache.data.view(torch.uint8).clone()


ALL_DTYPES = [d.value for d in KVDtype]


@pytest.mark.parametrize("kv_dtype", ALL_DTYPES)
def test_clear_zeroes_listed_nan_pages_in_every_plane_and_nothing_else(kv_dtype):
    cache = make_cache(kv_dtype)
    fill_random(cache)
    # A live sequence owns page 5 (slots 0..1 written) and page 8 (full).
    live_k = torch.randn(PAGE_SIZE + 2, HEADS, HEAD_DIM)
    pages = torch.tensor([8] * PAGE_SIZE + [5, 5])
    offsets = torch.tensor(list(range(PAGE_SIZE)) + [0, 1])
    for layer in range(LAYERS):
        cache.write(layer, pages, offsets, live_k, -live_k)
    poisoned = np.array([2, 3, 4, 7, 10, 11], dtype=np.int32)
    cache.poison_pages(poisoned)
    as_float = cache.data.float()
    assert bool(torch.isnan(as_float[poisoned]).all()), "0xFF bytes must read as NaN in this dtype"

    listed = np.array([2, 3, 4, 7, 10], dtype=np.int32)  # runs (2..4), (7), (10); page 11 stays poisoned
    before = raw(cache)
    cache.clear_pages(listed)
    after = raw(cache)

    assert bool((after[listed] == 0).all()), "every byte of every plane of a listed page is zero"
    assert bool((cache.data[listed].float() == 0).all())
    others = np.setdiff1d(np.arange(NUM_PAGES + 1), listed)
    assert torch.equal(after[others], before[others]), "unlisted pages must be byte-identical"
    assert bool(torch.isnan(cache.data[11].float()).all()), "an unlisted poisoned page keeps its bytes"
    for layer in range(LAYERS):
        k, v = cache.key_value(layer)
        assert torch.equal(k[8].view(torch.uint8), before[8, layer, 0])
        assert torch.equal(v[5, :2].view(torch.uint8), before[5, layer, 1, :2])
    assert bool((after[cache.pad_page] == 0).all())


@pytest.mark.parametrize("kv_dtype", ALL_DTYPES)
def test_poisoned_allocation_is_nan_everywhere_but_the_pad_page(kv_dtype):
    cache = make_cache(kv_dtype, poison=True)
    assert bool(torch.isnan(cache.data[: cache.pad_page].float()).all())
    assert bool((cache.data[cache.pad_page].view(torch.uint8) == 0).all())


def test_clear_of_nothing_changes_nothing():
    cache = make_cache("bf16")
    fill_random(cache)
    before = raw(cache)
    cache.clear_pages(np.zeros(0, dtype=np.int32))
    assert torch.equal(raw(cache), before)


@pytest.mark.parametrize("kv_dtype", ALL_DTYPES)
def test_offload_then_restore_is_byte_identical(kv_dtype):
    cache = make_cache(kv_dtype, num_host_pages=4)
    fill_random(cache, seed=1)
    before = raw(cache)
    cache.offload(np.array([3, 6, 9], dtype=np.int32), np.array([2, 0, 3], dtype=np.int32))
    cache.poison_pages(np.array([3, 6, 9], dtype=np.int32))
    assert not torch.equal(raw(cache)[3], before[3])
    # Restore page 6's bytes into a different page too: a restore targets any page.
    cache.restore(np.array([3, 6, 9, 1], dtype=np.int32), np.array([2, 0, 3, 0], dtype=np.int32))
    after = raw(cache)
    for page in (3, 6, 9):
        assert torch.equal(after[page], before[page])
    assert torch.equal(after[1], before[6])
    untouched = [p for p in range(NUM_PAGES + 1) if p not in (1, 3, 6, 9)]
    assert torch.equal(after[untouched], before[untouched])
