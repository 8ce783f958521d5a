"""The CUDA graph runner's static decode buffers, checked on the CPU (capture itself needs a GPU)."""

import torch

from dataclasses import replace

from executor.cuda_graphs import StaticDecodeBatch, graph_widths
from executor.inputs import StepInputs
from tests.executor.executor_standin import KV_HEADS, Seq, StandInModel, geometry, make_cache, make_prepare

G = geometry()


def inputs_of(prepare, cache):
    return StepInputs.from_prepare(prepare, pad_page=cache.pad_page, page_size=cache.page_size, device="cpu")


def zero_cache():
    cache = make_cache(G, KV_HEADS, poison=False)
    cache.data.zero_()
    return cache


def test_a_padded_decode_step_gives_the_real_steps_logits_and_writes():
    model = StandInModel(0, 1)
    eager_cache, static_cache = zero_cache(), zero_cache()
    batch = StaticDecodeBatch(4, 8, G, static_cache)
    bigger = make_prepare([Seq(1, (5,), 6, (0, 1)), Seq(2, (9,), 2, (3,)), Seq(3, (12,), 0, (5,))])
    step = make_prepare([Seq(1, (6,), 7, (0, 1))])
    for prepare in (bigger, step):  # the smaller step after the bigger one: stale rows re-padded
        real = inputs_of(prepare, eager_cache)
        expected = model.forward(real, eager_cache)
        batch.load(inputs_of(prepare, static_cache))
        logits = model.forward(batch.inputs, static_cache)
        n = real.num_seqs
        assert torch.equal(logits[:n], expected)
        pages = slice(0, static_cache.pad_page)
        assert torch.equal(static_cache.data[pages], eager_cache.data[pages]), "padding rows wrote a real page"
    static = batch.inputs
    assert bool((static.page_table[1:] == static_cache.pad_page).all())
    assert bool((static.write_pages[1:] == static_cache.pad_page).all())
    assert static.page_table.shape == (4, 8)


def test_only_pure_decode_steps_that_fit_use_a_graph():
    cache = zero_cache()
    batch = StaticDecodeBatch(2, 4, G, cache)
    assert batch.fits(inputs_of(make_prepare([Seq(1, (5,), 3, (0,))]), cache))
    wide = make_prepare([Seq(1, (5,), 16, (0, 1, 2, 3, 4))])  # 17 tokens of context: 5 pages
    assert not batch.fits(inputs_of(wide, cache))
    assert not batch.fits(inputs_of(make_prepare([Seq(1, (5, 6), 0, (0,))]), cache)), "prefill runs eagerly"
    three = make_prepare([Seq(i, (5,), 3, (i,)) for i in range(3)])
    assert not batch.fits(inputs_of(three, cache))


def test_graph_widths_are_powers_of_two_up_to_the_widest_table():
    assert graph_widths(replace(G, max_model_len=8192, page_size=16)) == [16, 32, 64, 128, 256, 512]
    assert graph_widths(replace(G, max_model_len=1000, page_size=16)) == [16, 32, 63]
    assert graph_widths(replace(G, max_model_len=100, page_size=16)) == [7]


def test_the_real_decode_forward_gives_the_same_logits_from_padded_static_buffers():
    from executor.model.config import ModelConfig
    from executor.model.layers import Linear
    from executor.model.llama import LayerWeights, LlamaModel
    from executor.model.sharding import ShardPlan

    config = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=KV_HEADS,
        head_dim=G.head_dim, rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5, tie_embeddings=True,
        max_position_embeddings=256, bos_token_id=None, eos_token_ids=(0,),
    )
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    q_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    layers = [
        LayerWeights(
            attn_norm=torch.ones(32), qkv=Linear(w(q_rows, 32)),
            o=Linear(w(32, config.num_heads * config.head_dim)),
            ffn_norm=torch.ones(32), gate_up=Linear(w(96, 32)), down=Linear(w(32, 48)),
        )
        for _ in range(config.num_layers)
    ]
    embed = w(64, 32)
    model = LlamaModel(
        config, ShardPlan.build(config, 0, 1), embed=embed, lm_head=embed, final_norm=torch.ones(32),
        layers=layers, fingerprint="tiny", device=torch.device("cpu"),
    )
    eager_cache, static_cache = zero_cache(), zero_cache()
    history = torch.randn(eager_cache.data[:6].shape, generator=g)
    eager_cache.data[:6] = history
    static_cache.data[:6] = history
    step = make_prepare([Seq(1, (5,), 6, (0, 1)), Seq(2, (9,), 2, (3,)), Seq(3, (7,), 4, (4, 5))])
    batch = StaticDecodeBatch(4, 8, G, static_cache)
    expected = model.forward(inputs_of(step, eager_cache), eager_cache)
    batch.load(inputs_of(step, static_cache))
    logits = model.forward(batch.inputs, static_cache)
    torch.testing.assert_close(logits[:3], expected, rtol=1e-5, atol=1e-5)
    # Batched matmuls round differently at another batch size: close, and no real page stray-written.
    pages = slice(0, static_cache.pad_page)
    torch.testing.assert_close(static_cache.data[pages], eager_cache.data[pages], rtol=1e-5, atol=1e-5)


def test_every_step_inputs_field_declares_a_padding_rule_and_the_guard_catches_one_that_does_not():
    """The runner's guard, run over every field of StepInputs as it is (nothing refused) and over
    a StepInputs with one more field that declares no rule (refused by name): a guard derived from
    the same list as the fields still has something to catch."""
    from dataclasses import field, fields, make_dataclass

    from executor.cuda_graphs import unpaddable_fields
    from executor.inputs import Pad

    assert unpaddable_fields() == []
    assert {f.metadata["pad"] for f in fields(StepInputs)} <= set(Pad)
    grown = make_dataclass("GrownInputs", [("grammar_mask", torch.Tensor, field(default=None))], bases=(StepInputs,))
    assert unpaddable_fields(grown) == ["grammar_mask"]


def test_padding_rows_follow_each_fields_rule():
    """Rows past the real step hold what each field's rule says, after a bigger step left others."""
    cache = zero_cache()
    batch = StaticDecodeBatch(4, 8, G, cache)
    for prepare in (make_prepare([Seq(i, (5,), 3, (i,)) for i in range(3)]), make_prepare([Seq(1, (6,), 7, (0, 1))])):
        batch.load(inputs_of(prepare, cache))
    static, context = batch.inputs, min(8 * G.page_size, G.max_model_len)
    assert static.token_ids[1:].eq(0).all() and static.positions[1:].eq(context - 1).all()
    assert static.context_lens[1:].eq(context).all() and static.write_pages[1:].eq(cache.pad_page).all()
    assert static.write_offsets[1:].eq((context - 1) % G.page_size).all()
    assert static.page_table[0, 2:].eq(cache.pad_page).all() and static.page_table[1:].eq(cache.pad_page).all()
