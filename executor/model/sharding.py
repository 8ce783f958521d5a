"""Which heads, vocabulary rows and FFN columns each rank holds.

Heads are split by KV group so that a rank's query heads only ever attend to its own KV heads.
With fewer ranks than groups the split is uneven where it must be (3 groups over 2 ranks: 2 + 1).
With more ranks than groups, each rank holds one KV head (replicated across the ranks that share
it) and the group's query heads are split among those ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from executor.model.config import ModelConfig
from protocol.errors import TPRuntimeError


class ShardingError(TPRuntimeError, ValueError):
    """The model cannot be split over the requested number of ranks."""


def even_split(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when `total` items are split into `parts` near-equal parts."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world_size: int
    q_heads: tuple[int, int]  # [start, stop) of global query heads
    kv_heads: tuple[int, int]  # [start, stop) of global KV heads
    vocab: tuple[int, int]  # [start, stop) of vocabulary rows
    vocab_chunk: int  # rows per rank before the last rank's trim: LM-head gathers pad to it
    ffn: tuple[int, int]  # [start, stop) of intermediate columns

    @property
    def local_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @classmethod
    def build(cls, config: ModelConfig, rank: int, world_size: int) -> ShardPlan:
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ShardingError(f"rank {rank} is not in a world of size {world_size}")
        groups, group = config.num_kv_heads, config.group_size
        if world_size <= groups:
            kv = even_split(groups, world_size, rank)
            q = (kv[0] * group, kv[1] * group)
        else:
            # Ranks are dealt to groups contiguously; the ranks sharing a group split its heads.
            kv_head = rank * groups // world_size
            sharers = [r for r in range(world_size) if r * groups // world_size == kv_head]
            if len(sharers) > group:
                raise ShardingError(
                    f"{world_size} ranks over {groups} KV groups of {group} query heads leave a "
                    f"rank without a query head; use at most {groups * group} ranks"
                )
            lo, hi = even_split(group, len(sharers), sharers.index(rank))
            kv = (kv_head, kv_head + 1)
            q = (kv_head * group + lo, kv_head * group + hi)
        chunk = -(-config.vocab_size // world_size)
        vocab = (min(rank * chunk, config.vocab_size), min((rank + 1) * chunk, config.vocab_size))
        if config.intermediate_size < world_size:
            raise ShardingError(
                f"intermediate size {config.intermediate_size} is smaller than world size {world_size}"
            )
        return cls(
            rank=rank,
            world_size=world_size,
            q_heads=q,
            kv_heads=kv,
            vocab=vocab,
            vocab_chunk=chunk,
            ffn=even_split(config.intermediate_size, world_size, rank),
        )


# The tensor-parallel size whose partial sums the deterministic mode forms at every size: one rank
# forms both of two ranks' partial sums and adds them as their all-reduce would (a + b).
INVARIANT_WORLD = 2


@dataclass(frozen=True)
class RowParallelCuts:
    """Where INVARIANT_WORLD ranks cut the input columns of the row-parallel matrices: o_proj
    (query heads x head_dim) and down (FFN columns), as bounds from 0 to the width."""

    o: tuple[int, ...]
    down: tuple[int, ...]

    @classmethod
    def of(cls, config: ModelConfig) -> RowParallelCuts | None:
        """None where the model does not split over INVARIANT_WORLD ranks."""
        try:
            plans = [ShardPlan.build(config, rank, INVARIANT_WORLD) for rank in range(INVARIANT_WORLD)]
        except ShardingError:
            return None
        o = (0, *(plan.q_heads[1] * config.head_dim for plan in plans))
        down = (0, *(plan.ffn[1] for plan in plans))
        return cls(o, down)
