"""The page tables an executor holds between steps, and how a PREPARE's deltas apply to them.

A decode step adds a page to one sequence in page_size, so sending every page table whole would make
the page tables most of a PREPARE (and of its HMAC). Instead each executor keeps the tables of the
sequences of its last PREPARE, and the next PREPARE sends, per sequence, how many pages of its table
the executor must already hold (`page_table_base`) and only the pages after them. Rules:

- base 0 sends the whole table and replaces whatever was held (a new sequence, a resend);
- base > 0 needs exactly `base` pages held for that sequence, or the frame is refused with
  PAGE_TABLE_BASE_MISMATCH and nothing changes: the two sides' states diverged, and guessing would
  let attention read pages the scheduler did not mean;
- a sequence absent from a step is forgotten; an ABORT forgets everything (`drop`), and the scheduler
  sends every table of its next step whole.

Pure numpy, no torch: the scheduler's tests apply PREPAREs through it just as the executors do.
"""

from __future__ import annotations

import numpy as np

from protocol.errors import ProtocolError, RejectCode
from protocol.frames import Prepare

_EMPTY_IDS = np.zeros(0, dtype=np.int64)


def delta_index(base: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where the pages of a PREPARE's page_table go: row i's are columns base[i]..lens[i]-1 of
    row i, in order. Returns (rows, columns), one entry per page, for fancy indexing."""
    counts = lens - base
    total = int(counts.sum())
    ends = counts.cumsum()
    rows = np.arange(lens.shape[0]).repeat(counts)
    return rows, np.arange(total) - (ends - lens).repeat(counts)


class HeldPageTables:
    """Each sequence's page table as of the last PREPARE that applied, as rows of one int32 array."""

    def __init__(self) -> None:
        self.drop()

    def drop(self) -> None:
        """Forget every table (after an ABORT): the next PREPARE must send whole tables."""
        self._ids = _EMPTY_IDS
        self._sorted = _EMPTY_IDS  # ids in increasing order, for searchsorted
        self._order = _EMPTY_IDS  # row of each entry of _sorted
        self._lens = np.zeros(0, dtype=np.int32)
        self._table = np.zeros((0, 0), dtype=np.int32)

    def held(self, seq_ids: np.ndarray) -> np.ndarray:
        """Pages held for each sequence (0 for one not held)."""
        return self._held(seq_ids)[1]

    def _held(self, seq_ids: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """The held row of each sequence (None: the same sequences in the same order, as in steady
        decode) and how many pages are held for it."""
        if np.array_equal(seq_ids, self._ids):
            return None, self._lens
        if not self._ids.shape[0]:
            return np.zeros(seq_ids.shape[0], dtype=np.int64), np.zeros(seq_ids.shape[0], dtype=np.int32)
        at = np.minimum(self._sorted.searchsorted(seq_ids), self._sorted.shape[0] - 1)
        found = self._sorted[at] == seq_ids
        rows = self._order[at]
        return rows, np.where(found, self._lens[rows], 0).astype(np.int32)

    def apply(self, p: Prepare) -> np.ndarray:
        """The whole page tables of p's sequences, concatenated in step order, from what is held
        and p's deltas; they become what is held. p must have passed validate_prepare."""
        seq_ids, lens, base = p.seq_ids, p.page_table_lens, p.page_table_base
        n = seq_ids.shape[0]
        rows, held = self._held(seq_ids)
        wrong = (base != 0) & (base != held)
        if wrong.any():
            i = int(wrong.nonzero()[0][0])
            raise ProtocolError(
                RejectCode.PAGE_TABLE_BASE_MISMATCH,
                f"sequence {int(seq_ids[i])} (index {i}) has page_table_base {int(base[i])} but this "
                f"executor holds {int(held[i])} pages of its table",
            )
        width = int(lens.max()) if n else 0
        table = np.zeros((n, width), dtype=np.int32)
        keep = min(width, self._table.shape[1])
        if keep:
            # Columns past base are overwritten by the deltas (base 0: the whole row).
            table[:, :keep] = self._table[:, :keep] if rows is None else self._table[rows, :keep]
        if p.page_table.shape[0]:
            table[delta_index(base, lens)] = p.page_table
        self._ids = seq_ids.copy()
        self._order = np.argsort(seq_ids, kind="stable")
        self._sorted = self._ids[self._order]
        self._lens = lens.astype(np.int32, copy=True)
        self._table = table
        return table[np.arange(width) < lens[:, None]]
