"""Host arrays onto the model's device without waiting for the device.

Every step copies small host arrays to the device: its inputs and feedback indices (staged on the
link thread while the step before runs), the sampler's row indices and uniforms, the logits
processing's tensors and grammar masks, a prefill's attention indices. From pageable memory the
CUDA driver may synchronize with the stream the copy goes on before it stages the bytes, and the
model's forwards run on that same stream: the H200 trace showed each such copy as a wait
(docs/control_plane.md, "On a GPU"), and a link thread that waits for the forward running cannot
stage the next step behind it. From pinned memory the copy is queued and the call returns. The
pinned block comes from torch's caching host allocator, which records the copy and hands the block
out again only once the copy is done. On the CPU the array is taken as it is, without a copy.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(host: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """`host` on `device`: the array itself on the CPU (shared, not copied), a queued copy from
    pinned memory on CUDA."""
    tensor = torch.from_numpy(host)
    device = torch.device(device)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
