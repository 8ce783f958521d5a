"""The oldest torch the runtime runs on, and the refusal of an older one before anything starts.

2.11 is the GPU machine's image (torch 2.11.0+cu130), the oldest torch the runtime is meant to run
on. What it uses came before 2.11 by torch's history: CUDA graphs (torch.cuda.CUDAGraph,
graph_pool_handle, graph with pool and stream), init_process_group's device_id, TCPStore's
master_listen_fd, torch.library.custom_op, torch.export with AOTInductor packages, and torchrun's
--signals-to-handle (pytorch#160690, August 2025), on which the SIGTERM drain depends. torchrun's
--shutdown-timeout came after 2.11 (pytorch#172596, March 2026): the launcher passes it only where
torchrun has it. The device check (docs/device.md) is what runs the CUDA paths on 2.11 itself.
"""

from __future__ import annotations

import re

from tp_runtime.config import ConfigError

MIN_TORCH = (2, 11)
MIN_TORCH_TEXT = ".".join(map(str, MIN_TORCH))


class TorchVersionError(ConfigError):
    """The installed torch is older than the runtime can run on, or its version is unreadable."""


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: '2.11.0+cu130' -> (2, 11); '2.12.0a0+git1' -> (2, 12)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise TorchVersionError(f"cannot read torch's version {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch(version: str) -> None:
    if release(version) < MIN_TORCH:
        raise TorchVersionError(
            f"torch {version} is installed; tp-runtime needs torch {MIN_TORCH_TEXT} or newer "
            f"(pip install 'torch>={MIN_TORCH_TEXT}')"
        )


def require_torch() -> None:
    import torch

    check_torch(torch.__version__)
