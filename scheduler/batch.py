"""The running batch: one row per request that holds KV pages, as columns of preallocated arrays.

A decode step is planned with a fixed number of array operations whatever the batch size, because
every per-request number the planner reads is a column here. One schema (COLUMNS) says what the
columns are, where each one's value comes from when a row is added, and which ones only change
when rows come and go (those are snapshotted once per change and shared by every PREPARE in
between). Rows are dense: a removed row is filled by the last one, so PREPARE order is row order.

A row is live while its request runs. A request that ends or is preempted while a step in flight
still reads or writes its pages keeps its row, no longer live, until that step has ended
(scheduler.inflight): its pages stay referenced, and a RESULT for it still finds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Callable

import numpy as np

from scheduler.request import Request


@dataclass(frozen=True)
class Column:
    name: str
    dtype: type
    source: Callable[[Request], object] | None = None  # its value for a new row; None: given, else 0
    constant: bool = False  # changes only when rows are added or removed


def _seed(req: Request) -> int:
    return -1 if req.params.seed is None else req.params.seed


def _last_token(req: Request) -> int:
    return req.tokens[req.num_tokens - 1]


def _min_len(req: Request) -> int:
    return req.prompt_len + req.params.min_tokens if req.params.min_tokens else 0


COLUMNS = (
    Column("req_id", np.int64, attrgetter("request_id"), constant=True),
    Column("arrival", np.int64, attrgetter("arrival")),
    Column("ncomp", np.int32),  # tokens whose KV is written, or will be by the steps planned so far
    Column("ntok", np.int32, attrgetter("num_tokens")),  # tokens known: prompt + samples received
    Column("pending", np.int32),  # samples of steps in flight that have not been received
    Column("npages", np.int32),  # committed pages: the page table
    Column("nres", np.int32),  # pages reserved after the committed ones
    Column("sent", np.int32),  # pages of the page table the executors hold
    Column("limit", np.int32, attrgetter("limit")),  # ntok at which the request ends by length
    Column("last", np.int32, _last_token),  # the last known token, fed by a decode
    Column("live", np.bool_, lambda req: True),  # planned; false while held for a step in flight
    Column("temperature", np.float32, attrgetter("params.temperature"), constant=True),
    Column("top_p", np.float32, attrgetter("params.top_p"), constant=True),
    Column("top_k", np.int32, attrgetter("params.top_k"), constant=True),
    Column("seed", np.int64, _seed, constant=True),
    Column("nlogprobs", np.uint8, attrgetter("params.top_logprobs"), constant=True),
    Column("presence", np.float32, attrgetter("params.presence_penalty"), constant=True),
    Column("frequency", np.float32, attrgetter("params.frequency_penalty"), constant=True),
    Column("repetition", np.float32, attrgetter("params.repetition_penalty"), constant=True),
    Column("min_p", np.float32, attrgetter("params.min_p"), constant=True),
    Column("stateful", np.bool_, attrgetter("params.stateful")),  # the executors hold a sampling state
    Column("min_len", np.int32, _min_len),  # ntok before which its stop tokens are banned (0: never)
)
CONSTANT = tuple(c.name for c in COLUMNS if c.constant)


def frozen(a: np.ndarray) -> np.ndarray:
    """A read-only copy: shared by every PREPARE of a batch whose rows did not change."""
    out = a.copy()
    out.setflags(write=False)
    return out


@dataclass(frozen=True)
class Snapshot:
    """The constant columns of the first n rows, frozen, and a few arrays every decode step uses."""

    version: int
    columns: dict[str, np.ndarray]
    rows: np.ndarray  # arange(n)
    ones: np.ndarray  # int32 ones: query lengths
    ones_u8: np.ndarray  # uint8 ones: sample and feedback flags
    zeros: np.ndarray  # int32 zeros: the placeholder tokens of feedback rows, and empty counts
    zeros_u8: np.ndarray  # uint8 zeros: no sampling state


class Batch:
    def __init__(self, max_rows: int, max_pages: int) -> None:
        for col in COLUMNS:
            setattr(self, col.name, np.zeros(max_rows, dtype=col.dtype))
        self._columns = [(col, getattr(self, col.name)) for col in COLUMNS]
        self.pages = np.zeros((max_rows, max_pages), dtype=np.int32)
        self.reqs: list[Request | None] = [None] * max_rows
        self.n = 0
        self.version = 0  # bumped whenever a row is added or removed
        self.moves = 0  # bumped whenever a removal moves another row
        self.num_live = 0
        # Rows (live or held) whose PREPARE entries need more than the columns: a sampling state, or
        # stop tokens banned before min_tokens. While there are none, a step skips that work.
        self.num_processed = 0
        self._snapshot: Snapshot | None = None

    def column(self, name: str) -> np.ndarray:
        return getattr(self, name)[: self.n]

    def add(self, reqs: list[Request], **given: np.ndarray | list | int) -> int:
        """Append rows for reqs (live, their counters from the requests, which hand them over);
        `given` sets the other columns (0 otherwise). Returns the first new row."""
        r0, k = self.n, len(reqs)
        sl = slice(r0, r0 + k)
        for col, arr in self._columns:
            if col.name in given:
                arr[sl] = given[col.name]
            elif col.source is not None:
                arr[sl] = [col.source(req) for req in reqs] if k > 1 else col.source(reqs[0])
            else:
                arr[sl] = 0
        self.reqs[sl] = reqs
        for r, req in enumerate(reqs, r0):
            req.row = r
            req.num_tokens = None
        self.num_processed += int(np.count_nonzero(self.stateful[sl] | (self.min_len[sl] > 0)))
        self.n += k
        self.num_live += k
        self.version += 1
        return r0

    def remove(self, r: int) -> Request:
        """Drop row r (its pages already released) and fill the hole with the last row. The
        request gets its token count back."""
        req = self.reqs[r]
        assert req is not None
        req.num_tokens = int(self.ntok[r])
        req.row = -1
        self.num_live -= bool(self.live[r])
        self.num_processed -= bool(self.stateful[r] or self.min_len[r])
        last = self.n - 1
        if r != last:
            for _, arr in self._columns:
                arr[r] = arr[last]
            k = int(self.npages[last] + self.nres[last])
            self.pages[r, :k] = self.pages[last, :k]
            moved = self.reqs[last]
            assert moved is not None
            self.reqs[r] = moved
            moved.row = r
            self.moves += 1
        self.reqs[last] = None
        self.n -= 1
        self.version += 1
        return req

    def hold(self, r: int) -> None:
        """Row r stops being planned; it keeps its pages until it is removed."""
        if self.live[r]:
            self.live[r] = False
            self.num_live -= 1

    def held_pages(self, r: int) -> np.ndarray:
        """Committed then reserved pages of row r (a copy)."""
        return self.pages[r, : int(self.npages[r] + self.nres[r])].copy()

    def table(self, r: int) -> np.ndarray:
        return self.pages[r, : int(self.npages[r])]

    def snapshot(self) -> Snapshot:
        """The constant columns, copied once per change of rows."""
        s = self._snapshot
        if s is None or s.version != self.version:
            n = self.n
            s = Snapshot(
                self.version,
                {name: frozen(getattr(self, name)[:n]) for name in CONSTANT},
                frozen(np.arange(n, dtype=np.int32)),
                frozen(np.ones(n, dtype=np.int32)),
                frozen(np.ones(n, dtype=np.uint8)),
                frozen(np.zeros(n, dtype=np.int32)),
                frozen(np.zeros(n, dtype=np.uint8)),
            )
            self._snapshot = s
        return s
