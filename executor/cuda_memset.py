"""Byte memsets of whole KV pages on the model stream, through the CUDA driver (cuda-python).

cuMemsetD8Async takes a raw device range, so a run of contiguous pages (one contiguous range across
every plane in the cache layout) is one driver call whatever the dtype, and it is queued on the
stream the forward runs on: it is ordered after the step's input copies and before the forward or
the CUDA graph replay without any synchronization. cuda-python is imported on first use, so the CPU
path never needs it.
"""

from __future__ import annotations

from types import ModuleType

import torch

from protocol.errors import TPRuntimeError


class CudaMemsetError(TPRuntimeError, RuntimeError):
    """A page memset could not be issued: no cuda-python, a non-CUDA tensor, a bad run, a driver error."""


_driver_module: ModuleType | None = None


def _driver() -> ModuleType:
    global _driver_module
    if _driver_module is None:
        try:
            from cuda.bindings import driver
        except ImportError:
            try:
                from cuda import cuda as driver  # cuda-python before 12.6
            except ImportError as exc:
                raise CudaMemsetError(
                    "cuda-python is not installed; it is needed to clear KV pages on CUDA "
                    "(pip install cuda-python, or the tp-runtime[cuda] extra)"
                ) from exc
        _driver_module = driver
    return _driver_module


def _check(driver: ModuleType, err: object, what: str) -> None:
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        label = name.decode() if isinstance(name, bytes) else str(err)
        raise CudaMemsetError(f"{what} failed: {label}")


def byte_ranges(base: int, page_bytes: int, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(device address, byte count) of each half-open page run [start, stop)."""
    return [(base + start * page_bytes, (stop - start) * page_bytes) for start, stop in runs]


def memset_runs(data: torch.Tensor, runs: list[tuple[int, int]], value: int) -> None:
    """Set every byte of each half-open page run [start, stop) of `data` (pages along dim 0).

    Runs are what executor.cache.page_runs makes. The memsets are queued on torch's current
    stream of data's device; this returns without waiting for them.
    """
    if not data.is_cuda:
        raise CudaMemsetError(f"memset_runs needs a CUDA tensor, got one on {data.device}")
    if not data.is_contiguous():
        raise CudaMemsetError("memset_runs needs a contiguous cache tensor (pages must be byte ranges)")
    if not 0 <= value <= 255:
        raise CudaMemsetError(f"memset value must be a byte (0..255), got {value}")
    num_kv_pages = data.shape[0]
    for start, stop in runs:
        if not 0 <= start < stop <= num_kv_pages:
            raise CudaMemsetError(f"page run [{start}, {stop}) is not inside the cache's {num_kv_pages} pages")
    if not runs:
        return
    driver = _driver()
    ranges = byte_ranges(data.data_ptr(), data.stride(0) * data.element_size(), runs)
    with torch.cuda.device(data.device):
        stream = driver.CUstream(torch.cuda.current_stream(data.device).cuda_stream)
        for (address, nbytes), (start, stop) in zip(ranges, runs):
            (err,) = driver.cuMemsetD8Async(driver.CUdeviceptr(address), value, nbytes, stream)
            _check(driver, err, f"cuMemsetD8Async of pages [{start}, {stop})")
