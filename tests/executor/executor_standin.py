"""Test-only pieces shared by the executor tests: a stand-in model and PREPARE builders.

The stand-in does what makes the clearing rule load-bearing, without weights: it writes every new
token's K/V, then reads every slot of every page in each sequence's table, masked past the context
the way paged attention masks (weight 0), so one NaN byte anywhere in a read page makes the row
non-finite (0 x NaN = NaN). Its logits put all the mass on (last token + sum over ranks of
rank + 1) % vocab, which proves the all_reduce ran with every peer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from executor.cache import KVCache
from executor.inputs import StepInputs
from protocol.frames import CacheGeometry, Prepare, plain_sampling

VOCAB = 64
LAYERS = 2
KV_HEADS = 4
HEAD_DIM = 4


@dataclass(frozen=True)
class StandInConfig:
    vocab_size: int = VOCAB
    num_layers: int = LAYERS
    num_kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    max_position_embeddings: int = 256
    eos_token_ids: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class StandInShard:
    local_kv_heads: int


class StandInModel:
    def __init__(self, rank: int, world_size: int, fingerprint: str = "stand-in-v1") -> None:
        self.rank = rank
        self.world_size = world_size
        self.fingerprint = fingerprint
        self.config = StandInConfig()
        # Uneven where it must be, like the real shard plan: 4 heads over 3 ranks is 2 + 1 + 1.
        self.shard = StandInShard(local_kv_heads=len(range(rank, KV_HEADS, world_size)))
        self.forward_calls = 0

    def forward(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor | None:
        self.forward_calls += 1
        ones = torch.ones(inputs.num_tokens, cache.num_kv_heads, cache.head_dim)
        for layer in range(cache.num_layers):
            cache.write(layer, inputs.write_pages, inputs.write_offsets, ones, ones)
        n, width = inputs.page_table.shape
        pages = cache.data[inputs.page_table].float()  # [n, W, L, 2, P, H, D]
        slots = pages.permute(0, 1, 4, 2, 3, 5, 6).reshape(n, width * cache.page_size, -1)
        visible = torch.arange(width * cache.page_size)[None, :] < inputs.context_lens[:, None]
        attended = (visible[:, :, None].float() * slots).sum(dim=(1, 2))  # [n]
        total = torch.tensor([float(self.rank + 1)])
        if self.world_size > 1:
            dist.all_reduce(total)
        if self.rank != 0:
            return None
        seq_of_row = torch.bucketize(inputs.sample_rows, inputs.query_start[1:], right=True)
        last_tokens = inputs.token_ids[inputs.sample_rows]
        logits = torch.zeros(inputs.sample_rows.shape[0], VOCAB)
        target = (last_tokens + int(total.item())) % VOCAB
        logits[torch.arange(logits.shape[0]), target] = 5.0
        return logits + 0.0 * attended[seq_of_row, None]


def load_standin(
    path: str, *, rank: int, world_size: int, dtype: torch.dtype, device: torch.device, weight_format: str,
    progress: bool, deterministic: bool = False,
) -> StandInModel:
    """load_model's signature; the model "path" is the fingerprint, so a test can make ranks disagree."""
    return StandInModel(rank, world_size, fingerprint=path)


def geometry(num_kv_pages: int = 16, page_size: int = 4, num_host_pages: int = 4) -> CacheGeometry:
    return CacheGeometry(
        num_kv_pages=num_kv_pages,
        page_size=page_size,
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        kv_dtype="fp32",
        vocab_size=VOCAB,
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_host_pages=num_host_pages,
    )


def make_cache(g: CacheGeometry, local_kv_heads: int, poison: bool) -> KVCache:
    return KVCache(
        num_kv_pages=g.num_kv_pages,
        page_size=g.page_size,
        num_layers=g.num_layers,
        num_kv_heads=local_kv_heads,
        head_dim=g.head_dim,
        kv_dtype=g.kv_dtype,
        device=torch.device("cpu"),
        num_host_pages=g.num_host_pages,
        poison=poison,
    )


@dataclass(frozen=True)
class Seq:
    """One sequence of a step: new tokens starting at `start`, on pages `pages`, of which the
    executor holds the first `held` from the previous step (only the others travel)."""

    seq_id: int
    tokens: tuple[int, ...]
    start: int
    pages: tuple[int, ...]
    seed: int = -1
    temperature: float = 0.0
    held: int = 0
    # Its one new token is its sample from the step run before (tokens holds the placeholder 0).
    feedback: bool = False


def _i32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def make_prepare(
    seqs: list[Seq],
    *,
    cleared: tuple[int, ...] = (),
    restore: tuple[tuple[int, int], ...] = (),
    offload: tuple[tuple[int, int], ...] = (),
    poison: tuple[int, ...] = (),
) -> Prepare:
    return Prepare(
        seq_ids=np.asarray([s.seq_id for s in seqs], dtype=np.int64),
        query_lens=_i32([len(s.tokens) for s in seqs]),
        context_lens=_i32([s.start + len(s.tokens) for s in seqs]),
        token_ids=_i32([t for s in seqs for t in s.tokens]),
        positions=_i32([s.start + i for s in seqs for i in range(len(s.tokens))]),
        page_table_lens=_i32([len(s.pages) for s in seqs]),
        page_table_base=_i32([s.held for s in seqs]),
        page_table=_i32([p for s in seqs for p in s.pages[s.held :]]),
        sample=np.ones(len(seqs), dtype=np.uint8),
        temperature=np.asarray([s.temperature for s in seqs], dtype=np.float32),
        top_p=np.ones(len(seqs), dtype=np.float32),
        top_k=_i32([0] * len(seqs)),
        seeds=np.asarray([s.seed for s in seqs], dtype=np.int64),
        cleared_pages=_i32(cleared),
        restore_pages=_i32([p for p, _ in restore]),
        restore_slots=_i32([s for _, s in restore]),
        offload_pages=_i32([p for p, _ in offload]),
        offload_slots=_i32([s for _, s in offload]),
        poison_pages=_i32(poison),
        feedback=np.asarray([s.feedback for s in seqs], dtype=np.uint8),
        **plain_sampling(len(seqs)),
    )
