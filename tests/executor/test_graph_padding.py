"""The CUDA graph runner's static decode buffers, checked on the CPU (capture itself needs a GPU)."""

from dataclasses import fields, replace

import numpy as np
import pytest
import torch

from executor.cuda_graphs import DecodeGraphRunner, StaticDecodeBatch, graph_widths, unpaddable_fields
from executor.inputs import Pad, StepInputs
from protocol.frames import Prepare
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


def tiny_llama(g: torch.Generator):
    """A two-layer Llama decode forward, the one CUDA graphs capture, on the CPU."""
    from executor.model.config import ModelConfig
    from executor.model.layers import Linear
    from executor.model.llama import LayerWeights, LlamaModel
    from executor.model.sharding import ShardPlan

    config = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=KV_HEADS,
        head_dim=G.head_dim, rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5, tie_embeddings=True,
        max_position_embeddings=256, bos_token_id=None, eos_token_ids=(0,),
    )

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
    return LlamaModel(
        config, ShardPlan.build(config, 0, 1), embed=embed, lm_head=embed, final_norm=torch.ones(32),
        layers=layers, fingerprint="tiny", device=torch.device("cpu"),
    )


def two_caches_with_history(g: torch.Generator):
    """Two caches whose first six pages hold the same random K/V, the rest zero."""
    first, second = zero_cache(), zero_cache()
    history = torch.randn(first.data[:6].shape, generator=g)
    first.data[:6] = history
    second.data[:6] = history
    return first, second


def test_the_real_decode_forward_gives_the_same_logits_from_padded_static_buffers():
    g = torch.Generator().manual_seed(0)
    model = tiny_llama(g)
    eager_cache, static_cache = two_caches_with_history(g)
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
    from dataclasses import field, make_dataclass

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


class Tripwire:
    """Stands for a field the decode forward must not read: any use of it raises."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attribute: str):
        raise AssertionError(f"the decode forward read StepInputs.{self.name} (.{attribute})")

    def __getitem__(self, index):
        raise AssertionError(f"the decode forward read StepInputs.{self.name}[{index}]")

    def __array__(self, *args, **kwargs):
        raise AssertionError(f"the decode forward read StepInputs.{self.name} as an array")


def logprob_prepare(seqs: list[Seq]) -> Prepare:
    """make_prepare's step, with every row asking for alternatives."""
    prepare = make_prepare(seqs)
    return replace(prepare, num_logprobs=np.full(len(seqs), 3, dtype=np.uint8))


def test_the_runner_pads_every_field_by_its_rule_on_the_cpu():
    """DecodeGraphRunner without capture builds the guard and the static buffers of every graph; a
    decode step of 2 sequences loaded into the 4-row graph is checked field by field, by rule."""
    g = torch.Generator().manual_seed(1)
    model, cache = tiny_llama(g), zero_cache()
    runner = DecodeGraphRunner(model, cache, geometry=G, batch_sizes=(1, 4), capture=False)
    real = inputs_of(logprob_prepare([Seq(1, (5,), 6, (0, 1)), Seq(2, (9,), 2, (3,))]), cache)
    assert real.sampling.host.num_logprobs.all(), "the step must ask for every optional output"
    captured = runner.graph_for(real)
    batch = captured.batch
    assert (batch.size, batch.width) == (4, runner.widths[0])
    batch.load(real)
    shape_only = StaticDecodeBatch(4, batch.width, G, zero_cache()).inputs  # as made, before any load
    n, static = real.num_seqs, batch.inputs
    checked = set()
    fill = batch.fills()
    for f in fields(StepInputs):
        name, rule = f.name, f.metadata["pad"]
        ours, theirs = getattr(static, name), getattr(real, name)
        if rule in fill:
            assert torch.equal(ours[:n], theirs), name
            assert bool((ours[n:] == fill[rule]).all()), name
        elif rule is Pad.PAGE_TABLE:
            width = theirs.shape[1]
            assert torch.equal(ours[:n, :width], theirs), name
            assert bool((ours[:n, width:] == cache.pad_page).all()) and bool((ours[n:] == cache.pad_page).all()), name
        elif rule is Pad.SAME:
            # Set when the buffers were made, never by a load; and right for the real step's rows.
            made = getattr(shape_only, name)
            assert (torch.equal(ours, made) if isinstance(ours, torch.Tensor) else np.array_equal(ours, made)), name
            head = ours[: theirs.shape[0]]
            assert (torch.equal(head, theirs) if isinstance(theirs, torch.Tensor) else np.array_equal(head, theirs)), name
        else:
            assert rule in (Pad.SAMPLER, Pad.CHECKED, Pad.LATER), name
        checked.add(rule)
    assert checked == set(Pad), "a kind of rule that no field exercises is untested"
    # SAMPLER fields, CHECKED host copies and the LATER forwards: the decode forward never reads
    # them, so a replay cannot depend on them.
    unread = {
        f.name: Tripwire(f.name)
        for f in fields(StepInputs)
        if f.metadata["pad"] in (Pad.SAMPLER, Pad.LATER) or (f.metadata["pad"] is Pad.CHECKED and f.name.endswith("_host"))
    }
    expected = model.forward(static, cache)
    tripped = model.forward(replace(static, **unread), cache)
    torch.testing.assert_close(tripped, expected)


def test_the_runner_without_capture_agrees_with_eager_and_a_padding_mistake_is_caught(monkeypatch):
    """What device_decode compares on the CPU: the padded static buffers against the plain forward.
    A padding row whose K/V goes to a real page (not the pad page) must make them disagree."""

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(2)
        model = tiny_llama(g)
        eager_cache, graph_cache = two_caches_with_history(g)
        runner = DecodeGraphRunner(model, graph_cache, geometry=G, batch_sizes=(4,), capture=False)
        step = make_prepare([Seq(1, (5,), 6, (0, 1)), Seq(2, (9,), 2, (3,))])
        expected = model.forward(inputs_of(step, eager_cache), eager_cache)
        runner.forward(inputs_of(step, graph_cache), graph_cache)  # the padding rows write their K/V
        again = make_prepare([Seq(1, (6,), 7, (0, 1)), Seq(2, (10,), 3, (3,))])
        expected = model.forward(inputs_of(again, eager_cache), eager_cache)
        return expected, runner.forward(inputs_of(again, graph_cache), graph_cache)

    expected, padded = run()
    torch.testing.assert_close(padded, expected, rtol=1e-5, atol=1e-5)
    real_fills = StaticDecodeBatch.fills
    monkeypatch.setattr(StaticDecodeBatch, "fills", lambda b: {**real_fills(b), Pad.PAD_PAGE: 0})  # page 0 is live
    expected, padded = run()
    assert not torch.allclose(padded, expected, rtol=1e-5, atol=1e-5), "a stray padding write went unnoticed"


def test_graphs_over_a_collective_that_cannot_be_captured_are_refused_at_start(monkeypatch):
    # On the GPU check, TP=2 over gloo with graphs died in capture on both ranks before HELLO, and
    # the engine waited out its handshake. The worker refuses it in a sentence, before any capture.
    from types import SimpleNamespace

    from executor.model import LlamaModel
    from executor.options import ExecutorOptions
    from executor.worker import ExecutorStartError, _step_model, check_graph_collectives

    check_graph_collectives(1, None)
    check_graph_collectives(2, "nccl")
    with pytest.raises(ExecutorStartError, match="NCCL.*gloo.*--enforce-eager"):
        check_graph_collectives(2, "gloo")
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    captured = []
    monkeypatch.setattr("executor.cuda_graphs.DecodeGraphRunner", lambda *a, **k: captured.append(a))
    monkeypatch.setattr("executor.model.runner.ModelRunner", lambda model, graphs: model)
    cuda_cache = SimpleNamespace(device=torch.device("cuda", 0))
    options = ExecutorOptions(model="unused", num_kv_pages=8, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, cuda_graphs=True)
    with pytest.raises(ExecutorStartError, match="gloo"):
        _step_model(options, LlamaModel.__new__(LlamaModel), cuda_cache, geometry(), world_size=2)
    assert captured == []
    _step_model(options, LlamaModel.__new__(LlamaModel), cuda_cache, geometry(), world_size=1)
    assert len(captured) == 1
