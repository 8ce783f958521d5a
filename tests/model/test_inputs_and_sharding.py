"""StepInputs built from a PREPARE, and the shard plans for even, uneven and replicated heads."""

from __future__ import annotations

import numpy as np
import pytest

from executor.inputs import StepInputs, StepInputsError
from executor.model.config import ModelConfig
from executor.model.sharding import ShardingError, ShardPlan
from protocol.frames import Prepare, plain_sampling


def _i32(*values) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def _prepare(**overrides) -> Prepare:
    # Sequence 10: a 3-token prefill chunk at positions 2..4; sequence 11: one decode token at 8.
    # Sequence 11 has a reserved page (30) past its context: it must not reach attention.
    fields = dict(
        seq_ids=np.array([10, 11], dtype=np.int64),
        query_lens=_i32(3, 1),
        context_lens=_i32(5, 9),
        token_ids=_i32(1, 2, 3, 4),
        positions=_i32(2, 3, 4, 8),
        page_table_lens=_i32(2, 4),
        page_table_base=_i32(0, 0),
        page_table=_i32(7, 8, 1, 2, 3, 30),
        sample=np.array([0, 1], dtype=np.uint8),
        temperature=np.array([0.5, 0.7], dtype=np.float32),
        top_p=np.array([1.0, 0.9], dtype=np.float32),
        top_k=_i32(0, 5),
        seeds=np.array([-1, 3], dtype=np.int64),
        cleared_pages=_i32(),
        restore_pages=_i32(),
        restore_slots=_i32(),
        offload_pages=_i32(),
        offload_slots=_i32(),
        poison_pages=_i32(),
        feedback=np.zeros(2, dtype=np.uint8),
        **plain_sampling(2),
    )
    fields.update(overrides)
    return Prepare(**fields)


def test_step_inputs_from_prepare():
    inputs = StepInputs.from_prepare(_prepare(), pad_page=99, page_size=4, device="cpu")
    assert inputs.page_table.tolist() == [[7, 8, 99], [1, 2, 3]]
    assert inputs.write_pages.tolist() == [7, 7, 8, 3]
    assert inputs.write_offsets.tolist() == [2, 3, 0, 0]
    assert inputs.query_start.tolist() == [0, 3, 4]
    assert inputs.sample_rows.tolist() == [3]
    assert inputs.sample_seq_ids.tolist() == [11]
    sampling = inputs.sampling
    assert sampling.host.positions.tolist() == [8] and sampling.host.seeds.tolist() == [3]
    assert sampling.top_k.tolist() == [5] and sampling.host.filtered.tolist() == [True] and not sampling.host.greedy.any()
    assert sampling.temperature.tolist() == pytest.approx([0.7]) and sampling.top_p.tolist() == pytest.approx([0.9])
    assert (inputs.num_seqs, inputs.num_tokens, inputs.is_decode) == (2, 4, False)


def test_decode_step_is_flagged():
    prepare = _prepare(
        query_lens=_i32(1, 1), context_lens=_i32(3, 9), token_ids=_i32(1, 4), positions=_i32(2, 8)
    )
    inputs = StepInputs.from_prepare(prepare, pad_page=99, page_size=4, device="cpu")
    assert inputs.is_decode and inputs.write_pages.tolist() == [7, 3]
    assert inputs.page_table.tolist() == [[7, 99, 99], [1, 2, 3]]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"context_lens": _i32(9, 9)}, "only 2 pages"),
        ({"query_lens": _i32(2, 1)}, "query_lens sum"),
        ({"page_table_lens": _i32(2, 3)}, "page_table_lens sum"),
    ],
)
def test_inconsistent_prepare_is_rejected(overrides, message):
    with pytest.raises(StepInputsError, match=message):
        StepInputs.from_prepare(_prepare(**overrides), pad_page=99, page_size=4, device="cpu")


def _config(num_heads: int, num_kv_heads: int, vocab: int = 49152, ffn: int = 1536) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab, hidden_size=576, intermediate_size=ffn, num_layers=1, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=64, rope_theta=1e4, rope_scaling=None, rms_eps=1e-5,
        tie_embeddings=True, max_position_embeddings=2048, bos_token_id=1, eos_token_ids=(2,),
    )


def _plans(config: ModelConfig, world: int) -> list[ShardPlan]:
    return [ShardPlan.build(config, rank, world) for rank in range(world)]


def test_smollm2_shape_splits_unevenly_over_two_ranks():
    plans = _plans(_config(9, 3, vocab=49153, ffn=1537), 2)
    assert [p.kv_heads for p in plans] == [(0, 2), (2, 3)]
    assert [p.q_heads for p in plans] == [(0, 6), (6, 9)]
    assert [p.vocab for p in plans] == [(0, 24577), (24577, 49153)]
    assert [p.ffn for p in plans] == [(0, 769), (769, 1537)]


def test_more_ranks_than_kv_heads_replicates_them():
    plans = _plans(_config(8, 2), 4)
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [p.q_heads for p in plans] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert all(p.local_kv_heads == 1 for p in plans)


def test_every_query_head_lives_on_exactly_one_rank():
    for heads, kv, world in [(9, 3, 3), (6, 3, 4), (12, 4, 8), (6, 1, 5), (32, 8, 3)]:
        owned = sorted(h for p in _plans(_config(heads, kv), world) for h in range(*p.q_heads))
        assert owned == list(range(heads)), (heads, kv, world)


def test_too_many_ranks_is_a_clear_error():
    with pytest.raises(ShardingError, match="without a query head"):
        ShardPlan.build(_config(2, 1), 0, 3)
