"""CPU dense matmuls run at a bounded set of row counts (executor/kernels.py padded_rows):
oneDNN keeps state for every shape it has run, so a server whose steps take every length would
grow without end. The rounding changes no result and bounds the shapes."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from executor.kernels import padded_rows
from executor.model.layers import Linear


def test_rows_round_up_by_at_most_an_eighth_to_8_sizes_per_doubling():
    sizes = [padded_rows(rows) for rows in range(1, 2049)]
    assert sizes[:16] == list(range(1, 17)), "small steps (decode batches) run exactly"
    for rows, size in enumerate(sizes, start=1):
        assert rows <= size <= rows * 1.125
    assert len(set(sizes[:512])) == 56 and len(set(sizes)) == 72
    assert sizes == sorted(sizes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_padded_matmul_gives_the_rows_asked_for(dtype):
    weight = torch.randn(96, 64).to(dtype)
    linear = Linear(weight)
    for rows in (1, 16, 17, 100, 513):
        x = torch.randn(rows, 64).to(dtype)
        y = linear(x)
        assert y.shape == (rows, 96) and y.is_contiguous()
        torch.testing.assert_close(y.float(), x.float() @ weight.float().t(), atol=0.05 if dtype == torch.bfloat16 else 1e-4, rtol=0.02)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_new_row_counts_within_known_sizes_cost_no_memory():
    libc = ctypes.CDLL("libc.so.6")

    def rss_mib() -> float:
        libc.malloc_trim(0)
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096 / 2**20

    linear = Linear(torch.randn(3072, 576))
    for rows in range(17, 513, 16):  # every size these counts round to, once
        linear(torch.randn(rows, 576))
    before = rss_mib()
    for rows in range(18, 513, 16):  # 31 row counts never run before, in the same sizes
        linear(torch.randn(rows, 576))
    # Unrounded, these 31 new shapes held ~18 MiB of oneDNN state for this one matrix.
    assert rss_mib() - before < 4.0
