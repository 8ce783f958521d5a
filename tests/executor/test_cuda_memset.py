"""What of the CUDA memset path can be checked without a GPU: byte ranges and clear errors."""

import sys

import pytest
import torch

from executor import cuda_memset
from executor.cache import page_runs
from executor.cuda_memset import CudaMemsetError, byte_ranges, memset_runs


def test_byte_ranges_cover_exactly_the_runs_pages():
    data = torch.empty(10, 3, 2, 4, 2, 8, dtype=torch.bfloat16)
    page_bytes = data.stride(0) * data.element_size()
    runs = page_runs([1, 2, 3, 7, 9])
    assert runs == [(1, 4), (7, 8), (9, 10)]
    ranges = byte_ranges(1000, page_bytes, runs)
    assert ranges == [(1000 + page_bytes, 3 * page_bytes), (1000 + 7 * page_bytes, page_bytes), (1000 + 9 * page_bytes, page_bytes)]
    # Each range is exactly the page's bytes in the tensor's own storage.
    flat = data.view(torch.uint8).reshape(-1)
    for (address, nbytes), (start, stop) in zip(byte_ranges(0, page_bytes, runs), runs):
        assert flat[address : address + nbytes].data_ptr() == data[start:stop].data_ptr()
        assert nbytes == data[start:stop].numel() * data.element_size()


def test_a_cpu_tensor_is_refused():
    with pytest.raises(CudaMemsetError, match="needs a CUDA tensor"):
        memset_runs(torch.zeros(4, 8), [(0, 1)], 0)


def test_missing_cuda_python_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cuda_memset, "_driver_module", None)
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules makes the import fail
    with pytest.raises(CudaMemsetError, match="pip install cuda-python"):
        cuda_memset._driver()
