"""The vectorized checks PREPARE's rules are built from: one numpy reduction per rule, the precise
message worked out only once it has failed."""

from __future__ import annotations

import numpy as np

from protocol.errors import ProtocolError, RejectCode

_UNSIGNED = {1: np.dtype(np.uint8), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def all_in_range(values: np.ndarray, high: int) -> bool:
    """Every value in [0, high). Viewed as unsigned, a negative value is huge, so one max() covers
    both bounds: one reduction instead of two matters at a few microseconds each."""
    return values.size == 0 or int(values.view(_UNSIGNED[values.dtype.itemsize]).max()) < high


def check_range(name: str, values: np.ndarray, high: int, code: RejectCode) -> None:
    if not all_in_range(values, high):
        i = first_bad((values < 0) | (values >= high))
        raise ProtocolError(code, f"{name}[{i}] = {values[i]} is outside [0, {high})")


def check_length(name: str, values: np.ndarray, expected: int, what: str) -> None:
    if len(values) != expected:
        raise ProtocolError(
            RejectCode.LENGTH_MISMATCH, f"{name} has {len(values)} entries; {what} is {expected}"
        )
