"""What a CONTINUE means: the PREPARE it stands for, built from the one before it.

A server spends nearly every step in steady decode: the same sequences as the step before, in the
same order, each decoding the token that step samples for it. Said as a PREPARE, such a step is 36
arrays that the scheduler encodes and MACs and every rank decodes, and almost all of them repeat
the step before. Said as a CONTINUE, it is the pages that some tables gain, the pages to clear and
the pages to poison; the rest follows from the PREPARE the rank accepted for the step before (held
by the rank's conversation, as page tables are held by protocol.page_tables).

`expand` is the one definition of that rule: the scheduler builds the PREPARE it keeps for a step
it sends as a CONTINUE with it, and every rank rebuilds the same PREPARE with it and validates it
like any other. Pure numpy, no torch.
"""

from __future__ import annotations

import functools

import numpy as np

from protocol.errors import ProtocolError, RejectCode
from protocol.frames import PREPARE_FIELDS, Continue, Extent, Prepare

# The per-sequence fields a CONTINUE keeps from the step before: the request's sampling parameters.
KEPT = (
    "seq_ids", "temperature", "top_p", "top_k", "seeds", "num_logprobs", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_p",
)
# The fields a CONTINUE carries itself.
CARRIED = ("cleared_pages", "poison_pages")
# The fields `expand` works out: one new token per sequence, the one fed back from its sample at
# the step before, in one more page where the CONTINUE appends one; a sampling state stays held.
WORKED_OUT = (
    "query_lens", "context_lens", "token_ids", "positions", "page_table_lens", "page_table_base", "page_table",
    "sample", "feedback", "sampling_state",
)
# Every other field is unused (declared defaults, empty lists): nothing restored or offloaded, no
# history, logit bias, grammar or banned tokens sent, as a held sampling state needs none of them.
UNUSED = tuple(f for f in PREPARE_FIELDS if f.name not in KEPT + CARRIED + WORKED_OUT)


@functools.lru_cache(maxsize=16)
def _constants(n: int) -> dict[str, np.ndarray]:
    """The arrays of an n-sequence CONTINUE that do not depend on its contents, read-only: shared by
    every expansion of that size, as the codec's decoded arrays are read-only too."""
    out = {
        f.name: np.full(n if f.extent is Extent.SEQUENCE else 0, f.default, dtype=f.dtype) for f in UNUSED
    }
    ones_i32, ones_u8 = np.ones(n, dtype=np.int32), np.ones(n, dtype=np.uint8)
    out.update(query_lens=ones_i32, token_ids=np.zeros(n, dtype=np.int32), sample=ones_u8, feedback=ones_u8)
    for a in out.values():
        a.setflags(write=False)
    return out


def expand(held: Prepare, c: Continue) -> Prepare:
    """The PREPARE that `c` stands for, after `held`, the PREPARE of the step before (validated).
    A CONTINUE that does not fit `held` is a ProtocolError: its new_pages must name one entry per
    held sequence, each a page or -1, and every held sequence must have been sampled, since its
    new token is that sample."""
    n = held.seq_ids.shape[0]
    new_pages = c.new_pages
    if new_pages.shape[0] != n:
        raise ProtocolError(
            RejectCode.LENGTH_MISMATCH, f"CONTINUE has {new_pages.shape[0]} new_pages for {n} held sequences"
        )
    grows = new_pages >= 0
    if n and int(new_pages.min()) < -1:
        raise ProtocolError(RejectCode.PAGE_OUT_OF_RANGE, "CONTINUE's new_pages hold a negative id other than -1")
    if not held.sample.all():
        i = int((held.sample == 0).nonzero()[0][0])
        raise ProtocolError(
            RejectCode.FEEDBACK_WITHOUT_SAMPLE,
            f"CONTINUE after a step that did not sample sequence {int(held.seq_ids[i])} (index {i})",
        )
    state = held.sampling_state
    # The step before ran decode_steps forwards: this one's first forward is one past its last.
    positions = held.final_context_lens.astype(np.int32)
    arrays = dict(_constants(n))
    arrays.update(
        {name: getattr(held, name) for name in KEPT},
        cleared_pages=c.cleared_pages,
        poison_pages=c.poison_pages,
        context_lens=positions + 1,
        positions=positions,
        page_table_lens=held.page_table_lens + grows.astype(np.int32),
        page_table_base=held.page_table_lens,
        page_table=new_pages[grows],
        sampling_state=np.where(state != 0, 2, 0).astype(np.uint8) if state.any() else state,
    )
    return Prepare(**arrays, decode_steps=c.decode_steps)
