"""KVCache: layout, clears and poison per dtype, fp8 scaling, host offload."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.cache import STORAGE_DTYPES, CacheConfigError, KVCache, page_runs
from executor.kv_scales import KVScales

CPU = torch.device("cpu")


def _cache(kv_dtype: str, **overrides) -> KVCache:
    options = dict(
        num_kv_pages=10, page_size=4, num_layers=2, num_kv_heads=3, head_dim=8, kv_dtype=kv_dtype, device=CPU
    )
    options.update(overrides)
    return KVCache(**options)


def test_page_runs_coalesce_consecutive_ids():
    assert page_runs(np.array([0, 1, 2, 5, 7, 8], dtype=np.int32)) == [(0, 3), (5, 6), (7, 9)]
    assert page_runs(np.array([], dtype=np.int32)) == []


@pytest.mark.parametrize("kv_dtype", sorted(STORAGE_DTYPES))
def test_poison_is_nan_and_clear_zeroes_exactly_the_listed_pages(kv_dtype):
    cache = _cache(kv_dtype, poison=True)
    assert cache.data.shape == (11, 2, 2, 4, 3, 8)
    assert cache.page_bytes == 2 * 2 * 4 * 3 * 8 * cache.data.element_size()
    assert torch.isnan(cache.data[: cache.num_kv_pages].float()).all(), "0xFF bytes read as NaN"
    assert not cache.data[cache.pad_page].float().any(), "the pad page is always zero"

    cleared = np.array([1, 2, 3, 6, 9], dtype=np.int32)
    before = cache.data.view(torch.uint8).clone()
    cache.clear_pages(cleared)
    after = cache.data.view(torch.uint8)
    for page in range(cache.num_kv_pages + 1):
        if page in cleared or page == cache.pad_page:
            assert not after[page].any()
        else:
            assert torch.equal(after[page], before[page])

    cache.poison_pages(np.array([2, 3], dtype=np.int32))
    assert (cache.data[2:4].view(torch.uint8) == 0xFF).all()
    assert not cache.data[[1, 6, 9]].float().any()


def test_clear_rejects_out_of_range_pages():
    with pytest.raises(IndexError, match="page ids"):
        _cache("fp32").clear_pages(np.array([3, 10], dtype=np.int32))


def test_write_lands_in_the_addressed_slots_and_fp8_applies_each_layers_scales():
    cache = _cache("fp8-e4m3", scales=KVScales(k=(2.0, 0.5), v=(1.0, 0.25), source="flag"))
    cache.clear_pages(np.arange(10, dtype=np.int32))
    k = torch.full((2, 3, 8), 1.5)
    v = torch.full((2, 3, 8), -1000.0)  # / 0.25 = -4000: clamped to the e4m3 limit
    cache.write(1, torch.tensor([4, 7]), torch.tensor([0, 3]), k, v)
    cache.write(0, torch.tensor([4]), torch.tensor([1]), k[:1], -k[:1])
    keys, values = cache.key_value(1)
    assert keys.shape == (11, 4, 3, 8) and keys.dtype == torch.float8_e4m3fn
    k_scale, v_scale = cache.layer_scales(1)
    assert (k_scale.item(), v_scale.item()) == (0.5, 0.25)
    assert (keys[4, 0].float() == 3.0).all() and (keys[4, 0].float() * k_scale == 1.5).all()
    assert (values[7, 3].float() == -448.0).all()
    assert (cache.key_value(0)[0][4, 1].float() == 0.75).all() and (cache.key_value(0)[1][4, 1].float() == -1.5).all()
    assert not keys[4, 1:].float().any() and not cache.key_value(0)[0][4, 0].float().any()


def test_unit_scales_are_the_default_and_scales_are_for_fp8_only():
    assert torch.equal(_cache("fp8-e4m3").scales, torch.ones(2, 2))
    with pytest.raises(CacheConfigError, match="fp8-e4m3 cache, not to bf16"):
        _cache("bf16", scales=KVScales.uniform(2, 0.5))
    with pytest.raises(CacheConfigError, match="3 layers of KV cache scales for a cache of 2"):
        _cache("fp8-e4m3", scales=KVScales.uniform(3, 0.5))


def test_offload_and_restore_round_trip_whole_pages():
    cache = _cache("bf16", num_host_pages=2, poison=True)
    original = cache.data[5].clone()
    cache.offload([5], [1])
    cache.clear_pages(np.array([5], dtype=np.int32))
    cache.restore([2], [1])
    assert torch.equal(cache.data[2].view(torch.uint8), original.view(torch.uint8))
    assert not cache.data[5].float().any()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"kv_dtype": "int4"}, "unknown KV cache dtype"), ({"num_kv_pages": 0}, "num_kv_pages")],
)
def test_bad_geometry_is_a_clear_error(overrides, message):
    with pytest.raises(CacheConfigError, match=message):
        _cache(**{"kv_dtype": "fp32", **overrides})
