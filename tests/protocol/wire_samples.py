"""Valid frames and geometries shared by the protocol tests and their spawned peers."""

from __future__ import annotations

import dataclasses

import numpy as np

from protocol.frames import ARRAY_DTYPES, CacheGeometry, Prepare, plain_sampling

KEY = bytes(range(32))
RUN_ID = "run-test"

GEOMETRY = CacheGeometry(
    num_kv_pages=512,
    page_size=16,
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    kv_dtype="fp32",
    vocab_size=1000,
    max_model_len=1024,
    max_num_seqs=64,
    max_num_batched_tokens=512,
    num_host_pages=32,
)

_PREPARE_DTYPES = ARRAY_DTYPES[Prepare]


def _arr(name: str, values: object) -> np.ndarray:
    return np.asarray(values, dtype=_PREPARE_DTYPES[name])


def valid_prepare(
    query_lens: tuple[int, ...] = (3, 1, 1, 2),
    context_lens: tuple[int, ...] = (3, 20, 33, 50),
    *,
    cleared_pages: tuple[int, ...] = (7, 8, 40),
    restore: tuple[tuple[int, int], ...] = ((100, 1), (101, 2)),
    offload: tuple[tuple[int, int], ...] = ((200, 3),),
    poison_pages: tuple[int, ...] = (300,),
    geometry: CacheGeometry = GEOMETRY,
    seed: int = 0,
) -> Prepare:
    """A PREPARE that satisfies every validation rule against `geometry`."""
    rng = np.random.default_rng(seed)
    n = len(query_lens)
    page_table_lens = [-(-c // geometry.page_size) for c in context_lens]
    positions = [c - q + j for q, c in zip(query_lens, context_lens) for j in range(q)]
    return Prepare(
        seq_ids=_arr("seq_ids", np.arange(n) + 1000),
        query_lens=_arr("query_lens", query_lens),
        context_lens=_arr("context_lens", context_lens),
        token_ids=_arr("token_ids", rng.integers(0, geometry.vocab_size, sum(query_lens))),
        positions=_arr("positions", positions),
        page_table_lens=_arr("page_table_lens", page_table_lens),
        page_table_base=_arr("page_table_base", np.zeros(n)),
        page_table=_arr("page_table", rng.integers(0, geometry.num_kv_pages, sum(page_table_lens))),
        sample=_arr("sample", np.ones(n)),
        temperature=_arr("temperature", np.linspace(0.0, 1.5, n)),
        top_p=_arr("top_p", np.ones(n)),
        top_k=_arr("top_k", np.zeros(n)),
        seeds=_arr("seeds", np.full(n, -1)),
        cleared_pages=_arr("cleared_pages", cleared_pages),
        restore_pages=_arr("restore_pages", [p for p, _ in restore]),
        restore_slots=_arr("restore_slots", [s for _, s in restore]),
        offload_pages=_arr("offload_pages", [p for p, _ in offload]),
        offload_slots=_arr("offload_slots", [s for _, s in offload]),
        poison_pages=_arr("poison_pages", poison_pages),
        feedback=_arr("feedback", np.zeros(n)),
        **plain_sampling(n),
    )


def with_arrays(p: Prepare, **arrays: object) -> Prepare:
    """A copy of `p` with some arrays replaced (converted to the field's wire dtype)."""
    return dataclasses.replace(p, **{name: _arr(name, v) for name, v in arrays.items()})
