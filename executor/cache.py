"""The paged KV cache of one rank: one tensor, one contiguous range per page.

Layout [num_kv_pages + 1, num_layers, 2, page_size, local_kv_heads, head_dim]: page i holds every
layer's K and V for its page_size slots, so clearing a run of pages is one fill (one memset on CUDA)
and offloading a page is one copy. The extra page `pad_page == num_kv_pages` is zeroed at allocation and
never handed out: vectorized attention pads page tables with it.

The storage is allocated uninitialized on purpose (DESIGN.md): the scheduler's clear marks, not the
allocator, are what keep attention from reading garbage, and `poison=True` makes garbage visible.

An fp8-e4m3 cache stores x / scale and reads stored * scale, with a K and a V scale per layer
(executor/kv_scales.py says where they come from). The scales are a tensor on the cache's device,
read by every write and every gather (and by CUDA graphs at replay, so calibrating them after
capture is seen); they are finite and positive, so a zeroed slot still reads back as exactly 0 and a
0xFF slot as NaN.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from executor.kv_scales import KVScales, ScaleCalibration
from protocol.errors import TPRuntimeError
from protocol.frames import KVDtype

STORAGE_DTYPES: dict[str, torch.dtype] = {
    KVDtype.FP32.value: torch.float32,
    KVDtype.BF16.value: torch.bfloat16,
    KVDtype.FP16.value: torch.float16,
    KVDtype.FP8_E4M3.value: torch.float8_e4m3fn,
}
# The largest finite float8_e4m3fn: what an fp8 cache clamps to.
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
POISON_BYTE = 0xFF


def to_storage(x: torch.Tensor, scale: torch.Tensor, storage_dtype: torch.dtype) -> torch.Tensor:
    """New K or V as the cache stores it: fp8 divides by its layer's scale and clamps to e4m3's range."""
    if storage_dtype == torch.float8_e4m3fn:
        return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(storage_dtype)
    return x.to(storage_dtype)


def from_storage(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored K or V read back in `dtype` (fp8: times its layer's scale; 0xFF stays NaN)."""
    if x.dtype == torch.float8_e4m3fn:
        return x.to(dtype) * scale
    return x.to(dtype)


def store_kv(
    data: torch.Tensor,
    layer: torch.Tensor,
    pages: torch.Tensor,
    offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """Write new tokens' K and V [T, H, D] of one layer (`layer`: long[1]) at (pages[t], offsets[t])
    of the whole cache tensor. Plain tensor ops: the eager forward and the compiled layers (which
    take the layer as an input, so that one library serves every layer) run this same code."""
    layers = layer.expand(pages.shape[0])
    k_scale, v_scale = scales[layer][0]
    plane = torch.zeros_like(pages)
    data.index_put_((pages, layers, plane, offsets), to_storage(k, k_scale, data.dtype))
    data.index_put_((pages, layers, plane + 1, offsets), to_storage(v, v_scale, data.dtype))


class CacheConfigError(TPRuntimeError, ValueError):
    """The cache geometry or dtype asked for cannot be built."""


def page_runs(pages: np.ndarray | Sequence[int]) -> list[tuple[int, int]]:
    """Coalesce sorted unique page ids into half-open runs [start, stop) of consecutive ids."""
    ids = np.asarray(pages, dtype=np.int64)
    if ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = ids[np.concatenate(([0], breaks))]
    stops = ids[np.concatenate((breaks - 1, [ids.size - 1]))] + 1
    return list(zip(starts.tolist(), stops.tolist()))


class KVCache:
    def __init__(
        self,
        *,
        num_kv_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: str,
        device: torch.device,
        num_host_pages: int = 0,
        poison: bool = False,
        scales: KVScales | ScaleCalibration | None = None,
    ) -> None:
        """scales (fp8 only): fixed per-layer scales, a calibration that the first armed forward
        runs (`begin_calibration`), or None for 1.0 everywhere."""
        for name, value in (
            ("num_kv_pages", num_kv_pages),
            ("page_size", page_size),
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value <= 0:
                raise CacheConfigError(f"KV cache {name} must be positive, got {value}")
        if num_host_pages < 0:
            raise CacheConfigError(f"KV cache num_host_pages must be >= 0, got {num_host_pages}")
        kv_dtype = kv_dtype.value if isinstance(kv_dtype, KVDtype) else kv_dtype
        if kv_dtype not in STORAGE_DTYPES:
            raise CacheConfigError(
                f"unknown KV cache dtype {kv_dtype!r}; expected one of {sorted(STORAGE_DTYPES)}"
            )
        if scales is not None and kv_dtype != KVDtype.FP8_E4M3.value:
            raise CacheConfigError(f"KV cache scales apply to an fp8-e4m3 cache, not to {kv_dtype}")
        if isinstance(scales, KVScales) and len(scales.k) != num_layers:
            raise CacheConfigError(f"{len(scales.k)} layers of KV cache scales for a cache of {num_layers} layers")
        self.num_kv_pages = num_kv_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_dtype = kv_dtype
        self.storage_dtype = STORAGE_DTYPES[kv_dtype]
        self.device = torch.device(device)
        self.pad_page = num_kv_pages
        shape = (num_kv_pages + 1, num_layers, 2, page_size, num_kv_heads, head_dim)
        self.data = torch.empty(shape, dtype=self.storage_dtype, device=self.device)
        if poison:
            self.data.view(torch.uint8).fill_(POISON_BYTE)
        self.data[self.pad_page].zero_()
        # Every layer asks for its K and V twice a step; views made once save ~8 ops per layer.
        self._layers = [(self.data[:, layer, 0], self.data[:, layer, 1]) for layer in range(num_layers)]
        # The layer index as store_kv and the attention gathers take it: long[1] on the device.
        self.layer_ids = [torch.tensor([layer], device=self.device) for layer in range(num_layers)]
        self.scales = torch.ones((num_layers, 2), dtype=torch.float32, device=self.device)  # [layer, K/V]
        if isinstance(scales, KVScales):
            self.scales.copy_(torch.tensor(list(zip(scales.k, scales.v)), dtype=torch.float32))
        self._layer_scales = [(self.scales[layer, 0], self.scales[layer, 1]) for layer in range(num_layers)]
        self._calibration = scales if isinstance(scales, ScaleCalibration) else None
        self._armed = False
        self.host = torch.empty(
            (num_host_pages, *shape[1:]),
            dtype=self.storage_dtype,
            pin_memory=self.device.type == "cuda",
        )

    @property
    def page_bytes(self) -> int:
        return self.data.stride(0) * self.data.element_size()

    @property
    def num_host_pages(self) -> int:
        return self.host.shape[0]

    def key_value(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as views [num_kv_pages + 1, page_size, H, D] in the storage dtype."""
        return self._layers[layer]

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V scale of one layer: 0-d float32 views of `scales`, on the cache's device."""
        return self._layer_scales[layer]

    @property
    def calibration_pending(self) -> bool:
        return self._calibration is not None and not self._calibration.done

    @property
    def calibrating(self) -> bool:
        """An armed calibration is under way: the forward must write through `write`, eagerly
        (compiled layers and CUDA graphs write K and V themselves)."""
        return self._armed and self.calibration_pending

    def begin_calibration(self) -> None:
        """Arm the pending calibration: the next forward's writes set the scales, layer by layer."""
        if not self.calibration_pending:
            raise RuntimeError("this KV cache has no calibration pending")
        self._armed = True

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """While a calibration is armed: set this layer's scales from the K and V about to be written."""
        if self.calibrating:
            self._calibration.observe(layer, k, v, self.scales)

    def write(
        self,
        layer: int,
        pages: torch.Tensor,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store new tokens' K and V [T, H, D] at (pages[t], offsets[t])."""
        self.observe(layer, k, v)
        store_kv(self.data, self.layer_ids[layer], pages, offsets, k, v, self.scales)

    def clear_pages(self, pages: np.ndarray) -> None:
        """Zero every byte of the listed pages (sorted unique ids) in every layer's K and V."""
        self._fill_runs(pages, 0)

    def clear_pages_beside(self, pages: np.ndarray) -> None:
        """clear_pages for a CPU cache, from a thread beside the one running the model's forward
        (executor/clear_ahead.py): each run is one memset on this thread with the GIL released,
        where torch's fill would wake its OpenMP pool beside the forward's and a numpy fill would
        hold the GIL that the forward's Python dispatch needs."""
        if self.device.type != "cpu":
            raise ValueError(f"clear_pages_beside clears a CPU cache, not one on {self.device}")
        runs = self._checked_runs(pages)
        base, page_bytes = self.data.data_ptr(), self.page_bytes
        for start, stop in runs:
            ctypes.memset(base + start * page_bytes, 0, (stop - start) * page_bytes)

    def poison_pages(self, pages: np.ndarray) -> None:
        """Debug fault injection: fill the listed pages with 0xFF bytes (NaN in every KV dtype)."""
        self._fill_runs(pages, POISON_BYTE)

    def _checked_runs(self, pages: np.ndarray) -> list[tuple[int, int]]:
        runs = page_runs(pages)
        if runs and (runs[0][0] < 0 or runs[-1][1] > self.num_kv_pages):
            raise IndexError(f"page ids must be in [0, {self.num_kv_pages}), got runs {runs}")
        return runs

    def _fill_runs(self, pages: np.ndarray, value: int) -> None:
        runs = self._checked_runs(pages)
        if not runs:
            return
        if self.device.type == "cuda":
            from executor.cuda_memset import memset_runs

            memset_runs(self.data, runs, value=value)
            return
        as_bytes = self.data.view(torch.uint8)
        for start, stop in runs:
            as_bytes[start:stop].fill_(value)

    def offload(self, pages: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray) -> None:
        """Copy whole pages to host slots (one copy per page: a page is contiguous)."""
        for page, slot in zip(np.asarray(pages).tolist(), np.asarray(slots).tolist(), strict=True):
            self.host[slot].copy_(self.data[page], non_blocking=True)

    def restore(self, pages: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray) -> None:
        """Copy host slots back over whole pages."""
        for page, slot in zip(np.asarray(pages).tolist(), np.asarray(slots).tolist(), strict=True):
            self.data[page].copy_(self.host[slot], non_blocking=True)
