"""Per-step model inputs, built from a validated PREPARE with vectorized numpy (no per-token loops).

All integer inputs are packed into one int64 buffer and moved to the device in one copy, then split
into views by name: on CUDA that is one host-to-device transfer per step instead of a dozen.

Each field declares how a CUDA graph pads it (`Pad`, in the field's metadata): a graph captured for
B sequences replays a step of n <= B with rows n.. padded so that they touch only the pad page
(executor/cuda_graphs.py applies the rules; a field without one makes the runner refuse to start).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from executor.host_copy import to_device
from executor.sampler import HostRows, SamplingBatch, draw_unseeded
from protocol.errors import TPRuntimeError
from protocol.frames import Prepare


# The sampler's rows of a rank that does not sample: none (one instance, never written).
_NONE = np.zeros(0, dtype=np.int64)
NO_SAMPLER_ROWS = HostRows.of(np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.float32), _NONE, _NONE, _NONE)


class StepInputsError(TPRuntimeError, ValueError):
    """A PREPARE whose arrays cannot describe a step (lengths or page tables disagree)."""


class Pad(enum.Enum):
    """How a decode step's field is padded from its n rows to a CUDA graph's B (cuda_graphs.py)."""

    ZERO = "zero"  # rows n.. hold 0 (a token id every vocabulary has)
    LAST_POSITION = "last_position"  # the last position a table of the graph's width holds
    FULL_CONTEXT = "full_context"  # the context such a table holds: every slot of the pad page
    PAGE_TABLE = "page_table"  # columns past the real width and rows n.. read the pad page
    PAD_PAGE = "pad_page"  # rows n.. write their K and V into the pad page
    LAST_SLOT = "last_slot"  # ... at the slot of LAST_POSITION
    SAME = "same"  # identical for every decode step of the graph's size (captured as built)
    SAMPLER = "sampler"  # read by the sampler from the real inputs, never by the graph
    CHECKED = "checked"  # host-side sizes and copies: `fits` compares them, the graph never reads them
    LATER = "later"  # the frame's later forwards, which next_forward takes from: never read by the graph


def _pad(rule: Pad):  # noqa: ANN202 - a dataclass field
    return field(metadata={"pad": rule})


@dataclass(frozen=True, slots=True)
class LaterForward:
    """What one forward after a frame's first (Prepare.decode_steps) reads besides its tokens,
    made with the first forward's inputs where the step is staged: between two forwards the
    model's thread only takes it (torch's arithmetic for it there cost ~160 us of a 16-row
    frame's ~330 us gap, cold after each forward, and the sampler's rows one position on ~60 more;
    bench_step --num-scheduler-steps 16)."""

    positions: torch.Tensor  # long[n]
    context_lens: torch.Tensor  # long[n]
    write_pages: torch.Tensor  # long[n]
    write_offsets: torch.Tensor  # long[n]
    context_lens_host: np.ndarray  # int64[n]
    sampling: SamplingBatch  # the forward before's, one position on (SamplingBatch.one_position_on)


@dataclass
class StepInputs:
    token_ids: torch.Tensor = _pad(Pad.ZERO)  # long[T]
    positions: torch.Tensor = _pad(Pad.LAST_POSITION)  # long[T]
    query_lens: torch.Tensor = _pad(Pad.SAME)  # long[n]
    query_start: torch.Tensor = _pad(Pad.SAME)  # long[n + 1], cumulative
    context_lens: torch.Tensor = _pad(Pad.FULL_CONTEXT)  # long[n]
    # long[n, W]: each sequence's pages covering its context_lens, padded with pad_page. Reserved
    # pages past the context are replaced by pad_page too: they may not be cleared yet.
    page_table: torch.Tensor = _pad(Pad.PAGE_TABLE)
    write_pages: torch.Tensor = _pad(Pad.PAD_PAGE)  # long[T]: the page of each new token's K/V
    write_offsets: torch.Tensor = _pad(Pad.LAST_SLOT)  # long[T]: its slot in that page
    sample_rows: torch.Tensor = _pad(Pad.SAME)  # long[m]: index into T of each sampled sequence's last new token
    sample_seq_ids: np.ndarray = _pad(Pad.SAMPLER)  # int64[m]
    # The sampled rows' parameters on the device and the host (seeds, positions and the
    # alternatives each wants only there), with the unseeded uniforms of the step's forwards, made
    # and checked here, where the PREPARE is staged (rank 0; empty elsewhere).
    sampling: SamplingBatch = _pad(Pad.SAMPLER)
    is_decode: bool = _pad(Pad.CHECKED)  # every sequence brings exactly one new token
    num_seqs: int = _pad(Pad.CHECKED)
    num_tokens: int = _pad(Pad.CHECKED)
    # Host copies the attention loop over prefill sequences reads without a device sync.
    query_lens_host: np.ndarray = _pad(Pad.CHECKED)  # int64[n]
    context_lens_host: np.ndarray = _pad(Pad.CHECKED)  # int64[n]
    # The frame's forwards after this one, in order (none for a step of one forward).
    later: tuple[LaterForward, ...] = _pad(Pad.LATER)

    @classmethod
    def from_prepare(
        cls, p: Prepare, *, pad_page: int, page_size: int, device: torch.device | str, page_table: np.ndarray | None = None,
        samples: bool = True, needed: np.ndarray | None = None,
    ) -> StepInputs:
        """`page_table`: the whole page tables, concatenated, that protocol.page_tables resolved
        from p's deltas; without it p must carry whole tables (every page_table_base 0).
        `samples`: whether this rank samples (rank 0). Elsewhere the sampler's parameters stay
        empty (NO_SAMPLER_ROWS), sparing every other rank their derivation each step.
        `needed`: pages_needed's, where the caller checked the step already (nothing is raised then)."""
        if page_table is None:
            if p.page_table_base.any():
                raise StepInputsError("a PREPARE with page-table deltas needs the held page tables")
            page_table = p.page_table
        n = int(p.seq_ids.shape[0])
        num_tokens = int(p.token_ids.shape[0])
        query_lens = p.query_lens.astype(np.int64)
        context_lens = p.context_lens.astype(np.int64)
        table_lens = p.page_table_lens.astype(np.int64)
        if needed is None:
            needed = pages_needed(p, page_table, page_size)
        query_start, table_start = _starts(query_lens), _starts(table_lens)
        flat_table = page_table.astype(np.int64)
        width = int(needed.max()) if n else 0
        positions = p.positions.astype(np.int64)
        sampled = p.sample.nonzero()[0]
        sample_rows = query_start[sampled + 1] - 1
        drawn = sampled if samples else sampled[:0]  # the rows whose sampler parameters this rank keeps
        # A frame of several forwards is a plain decode step (validated): forward f's token of
        # sequence i is at positions[i] + f, in the same tables.
        later_positions = positions + np.arange(1, p.decode_steps, dtype=np.int64)[:, None]  # [d - 1, n]
        later_tables = table_start[:-1] if p.decode_steps > 1 else 0
        ints = _int64_on_device(
            device,
            token_ids=p.token_ids.astype(np.int64),
            positions=positions,
            query_lens=query_lens,
            query_start=query_start,
            context_lens=context_lens,
            page_table=_padded_tables(flat_table, table_start, needed, width, pad_page).reshape(-1),
            write_pages=_write_pages(flat_table, table_start, query_lens, positions, page_size),
            write_offsets=positions % page_size,
            sample_rows=sample_rows,
            top_k=p.top_k[drawn].astype(np.int64),
            later_positions=later_positions.reshape(-1),
            later_context_lens=(later_positions + 1).reshape(-1),
            later_write_pages=flat_table[later_tables + later_positions // page_size].reshape(-1),
            later_write_offsets=(later_positions % page_size).reshape(-1),
        )
        later_ints = {name: ints.pop(name) for name in _LATER_PIECES}
        m = int(drawn.shape[0])
        host_floats = np.concatenate((p.temperature[drawn], p.top_p[drawn])).astype(np.float32)
        floats = to_device(host_floats, device)
        ints["page_table"] = ints["page_table"].view(n, width)
        top_k = ints.pop("top_k")
        if samples:  # from the same float32 values as the tensors, so that the two agree on every row
            host = HostRows.of(
                host_floats[:m], host_floats[m:], p.top_k[drawn], p.seeds[drawn], positions[sample_rows], p.num_logprobs[drawn]
            )  # fmt: skip
            random = host.random.shape[0]
            sampling = SamplingBatch(
                floats[:m], floats[m:], top_k, host, unseeded=draw_unseeded(p.decode_steps, random) if random else None
            )
        else:
            sampling = SamplingBatch(floats[:m], floats[m:], top_k, NO_SAMPLER_ROWS)
        return cls(
            **ints,
            sample_seq_ids=p.seq_ids[sampled].astype(np.int64),
            sampling=sampling,
            is_decode=bool(n > 0 and np.all(query_lens == 1)),
            num_seqs=n,
            num_tokens=num_tokens,
            query_lens_host=query_lens,
            context_lens_host=context_lens,
            later=_later_forwards(later_ints, later_positions + 1, sampling),
        )

    def next_forward(self, token_ids: torch.Tensor) -> StepInputs:
        """The inputs of the forward after this one in a step of several (Prepare.decode_steps):
        every sequence decodes `token_ids` (what this forward sampled for it, on the device), one
        position on, in the same page table. Nothing is computed on the device, nothing waits for it."""
        if not self.later:
            raise StepInputsError("next_forward of a step's last forward")
        forward = self.later[0]
        return replace(
            self,
            token_ids=token_ids,
            positions=forward.positions,
            context_lens=forward.context_lens,
            write_pages=forward.write_pages,
            write_offsets=forward.write_offsets,
            sampling=forward.sampling,
            context_lens_host=forward.context_lens_host,
            later=self.later[1:],
        )


def pages_needed(p: Prepare, page_table: np.ndarray, page_size: int) -> np.ndarray:
    """The pages each sequence's context covers, once p's lengths are checked to describe one step
    and each sequence's table (`page_table`: the whole tables, concatenated) to hold its context;
    StepInputsError where they do not. A step of several forwards reads, from its first, the pages
    its last one needs: they are all cleared before the first (Prepare.decode_steps), and the
    tables keep one width."""
    query_lens, table_lens, context_lens = p.query_lens.astype(np.int64), p.page_table_lens.astype(np.int64), p.final_context_lens
    num_tokens = p.token_ids.shape[0]
    if query_lens.sum() != num_tokens or p.positions.shape[0] != num_tokens:
        raise StepInputsError(
            f"query_lens sum to {int(query_lens.sum())} but the step has {num_tokens} token ids "
            f"and {p.positions.shape[0]} positions"
        )
    if table_lens.sum() != page_table.shape[0]:
        raise StepInputsError(
            f"page_table_lens sum to {int(table_lens.sum())} but page_table has "
            f"{page_table.shape[0]} entries"
        )
    needed = -(-context_lens // page_size)
    if np.any(needed > table_lens):
        bad = int((needed > table_lens).nonzero()[0][0])
        raise StepInputsError(
            f"sequence {int(p.seq_ids[bad])} has {int(context_lens[bad])} tokens of context "
            f"but only {int(table_lens[bad])} pages of {page_size} slots"
        )
    return needed


def _starts(lens: np.ndarray) -> np.ndarray:
    """[0, cumulative sums]: where each sequence's run begins, and the total at the end."""
    starts = np.zeros(lens.shape[0] + 1, dtype=np.int64)
    lens.cumsum(out=starts[1:])
    return starts


def _padded_tables(
    flat_table: np.ndarray, table_start: np.ndarray, needed: np.ndarray, width: int, pad_page: int
) -> np.ndarray:
    """[n, width]: each sequence's pages covering its context, then pad_page. Reserved pages past
    the context are not read: they may not be cleared yet."""
    n = needed.shape[0]
    if not flat_table.size:
        return np.full((n, width), pad_page, dtype=np.int64)
    columns = np.arange(width, dtype=np.int64)
    in_context = columns[None, :] < needed[:, None]
    gather = np.where(in_context, table_start[:n, None] + columns[None, :], 0)
    return np.where(in_context, flat_table[gather], pad_page)


def _write_pages(
    flat_table: np.ndarray, table_start: np.ndarray, query_lens: np.ndarray, positions: np.ndarray, page_size: int
) -> np.ndarray:
    """The page each new token's K and V go to."""
    if not positions.shape[0]:
        return np.zeros(0, dtype=np.int64)
    seq_of_token = np.arange(query_lens.shape[0], dtype=np.int64).repeat(query_lens)
    return flat_table[table_start[seq_of_token] + positions // page_size]


_LATER_PIECES = ("later_positions", "later_context_lens", "later_write_pages", "later_write_offsets")


def _later_forwards(pieces: dict[str, torch.Tensor], context_lens: np.ndarray, sampling: SamplingBatch) -> tuple[LaterForward, ...]:
    """The frame's later forwards from _int64_on_device's flat _LATER_PIECES, one LaterForward per
    row of `context_lens` ([d - 1, n], their host copy), each with the sampler's rows of the
    forward before one position on."""
    rows = context_lens.shape[0]
    if not rows:
        return ()
    columns = zip(*(pieces[name].view(rows, -1).unbind(0) for name in _LATER_PIECES), context_lens)
    later = []
    for *tensors, host in columns:
        sampling = sampling.one_position_on()
        later.append(LaterForward(*tensors, host, sampling))
    return tuple(later)


def _int64_on_device(device: torch.device | str, **pieces: np.ndarray) -> dict[str, torch.Tensor]:
    """The named pieces in one host-to-device copy, as views of it under the same names."""
    packed = to_device(np.concatenate(list(pieces.values())), device)
    return dict(zip(pieces, torch.split(packed, [piece.shape[0] for piece in pieces.values()])))
