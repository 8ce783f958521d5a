"""executor.host_copy: what a CUDA device gets (a queued copy from pinned memory) is built here on the
CPU with torch's calls stood in; and no step's host-to-device copy goes around it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from executor.host_copy import to_device

EXECUTOR = Path(__file__).resolve().parents[2] / "executor"


def test_on_the_cpu_the_array_is_taken_as_it_is() -> None:
    host = np.arange(6, dtype=np.int64)
    tensor = to_device(host, "cpu")
    host[0] = 41
    assert tensor.device.type == "cpu" and int(tensor[0]) == 41  # shared, not copied


def test_on_cuda_the_copy_is_queued_from_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []

    def pin_memory(self: torch.Tensor) -> torch.Tensor:
        calls.append(("pin", tuple(self.tolist())))
        return self.clone()

    def to(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls.append(("to", args, kwargs))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    to_device(np.array([3, 4], dtype=np.int64), "cuda:1")
    assert calls == [("pin", (3, 4)), ("to", (torch.device("cuda:1"),), {"non_blocking": True})]


def test_another_device_gets_a_plain_queued_copy() -> None:
    tensor = to_device(np.ones(3, dtype=np.float32), torch.device("meta"))
    assert tensor.device.type == "meta" and tensor.shape == (3,)


def test_every_host_to_device_copy_of_the_executor_goes_through_it() -> None:
    # A torch.from_numpy(...).to(device) from pageable memory may wait for the forward running on
    # the stream (the module says why): none is written outside executor/host_copy.py.
    raw = re.compile(r"from_numpy\([^\n]*\)\s*\.to\(|\.pin_memory\(")
    found = [
        f"{path.relative_to(EXECUTOR.parent)}:{text[: m.start()].count(chr(10)) + 1}"
        for path in EXECUTOR.rglob("*.py")
        if path.name != "host_copy.py"
        for text in [path.read_text()]
        for m in raw.finditer(text)
        if "dtype" not in text[m.end() : m.end() + 40]  # a cast on the host (.to(torch.float16)) is not a copy
    ]
    assert found == []
