"""The inputs of a step's later forwards (Prepare.decode_steps, StepInputs.next_forward), against
the inputs the same forward gets as a step of its own, and through a CUDA graph's static buffers,
whose padding rules must take them as they take any decode step (checked on the CPU); and the
model's thread ending such a step where a CUT says."""

from collections.abc import Callable
from dataclasses import fields, replace

import numpy as np
import pytest
import torch

from executor.cuda_graphs import StaticDecodeBatch
from executor.inputs import Pad, StepInputs, StepInputsError
from executor.link import StagedStep, feedback_on_device
from executor.options import ExecutorOptions
from executor.sampler import HostOutputs, sample
from executor.steps import StepRunner
from protocol.frames import Result
from tests.executor.executor_standin import KV_HEADS, Seq, StandInModel, geometry, make_cache, make_prepare

G = geometry()  # 4-slot pages
PAGES = {1: (0, 1, 2), 2: (3,), 3: (5, 6)}
STARTS = {1: 6, 2: 0, 3: 3}  # sequence 1 crosses into its third page at its third forward, 3 at its second
FORWARDS = 3


def inputs_of(prepare) -> StepInputs:
    return StepInputs.from_prepare(prepare, pad_page=G.num_kv_pages, page_size=G.page_size, device="cpu")


def step(forward: int, tokens: dict[int, int], forwards: int = 1):
    """Forward `forward` of the step, said as a step of its own (with the tables the whole step holds)."""
    seqs = [Seq(s, (tokens[s],), STARTS[s] + forward, PAGES[s]) for s in PAGES]
    return replace(make_prepare(seqs), decode_steps=forwards)


def test_each_later_forward_gets_the_inputs_of_a_step_of_its_own() -> None:
    first = {1: 11, 2: 12, 3: 13}
    inputs = inputs_of(step(0, first, FORWARDS))
    for forward in range(1, FORWARDS):
        sampled = {1: 20 + forward, 2: 30 + forward, 3: 40 + forward}
        inputs = inputs.next_forward(torch.tensor(list(sampled.values())))
        alone = inputs_of(step(forward, sampled))
        for name in ("token_ids", "positions", "context_lens", "write_pages", "write_offsets", "sample_rows"):
            assert torch.equal(getattr(inputs, name), getattr(alone, name)), (forward, name)
        assert np.array_equal(inputs.context_lens_host, alone.context_lens_host)
        assert np.array_equal(inputs.sampling.host.positions, alone.sampling.host.positions)  # seeded draws are keyed by it
        # The whole step's tables from its first forward: its own pages cover the step's last one.
        width = alone.page_table.shape[1]
        assert torch.equal(inputs.page_table[:, :width], alone.page_table)
    with pytest.raises(StepInputsError, match="last forward"):
        inputs.next_forward(torch.tensor([1, 2, 3]))


def test_a_steps_unseeded_uniforms_are_drawn_where_it_is_staged_forward_after_forward() -> None:
    """The sample between two forwards draws nothing from torch's generator: the step's uniforms
    come with its inputs, one row per forward, the numbers one draw per forward would give."""
    prepare = replace(step(0, {1: 11, 2: 12, 3: 13}, FORWARDS), seeds=np.array([7, -1, 9], dtype=np.int64))
    prepare = replace(prepare, temperature=np.array([0.5, 0.8, 0.0], dtype=np.float32))
    torch.manual_seed(5)
    inputs = inputs_of(prepare)
    torch.manual_seed(5)
    expected = [torch.rand(2).numpy() for _ in range(FORWARDS)]  # rows 0 and 1 draw; row 2 is greedy
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    for forward in range(FORWARDS):
        params = inputs.sampling
        assert params.unseeded.shape == (FORWARDS - forward, 2)
        unseeded = params.unseeded[0].copy()
        np.testing.assert_array_equal(unseeded, expected[forward])
        before = torch.get_rng_state()
        first = sample(logits, params)
        again = sample(logits, params)
        assert torch.equal(torch.get_rng_state(), before), "the sample drew from torch's generator"
        assert torch.equal(first.token_ids, again.token_ids)
        uniforms = params.uniforms()
        assert uniforms[1] == unseeded[1] and uniforms[0] != unseeded[0]  # row 0's seed decides its own
        if forward < FORWARDS - 1:
            inputs = inputs.next_forward(first.token_ids)


def test_the_first_forward_reads_the_pages_of_the_last() -> None:
    """Pages the later forwards open are in the table from the first (cleared before it: they read
    as zeros past the context, which the attention masks)."""
    inputs = inputs_of(step(0, {1: 1, 2: 2, 3: 3}, FORWARDS))
    assert inputs.page_table[0].tolist() == [0, 1, 2]
    assert inputs.context_lens.tolist() == [7, 1, 4]  # the first forward's


def test_later_forwards_replay_through_a_graphs_static_buffers() -> None:
    """A CUDA graph copies each forward's inputs into its static buffers by their padding rules:
    the padded forwards give the eager ones' logits and write the same pages."""
    model = StandInModel(0, 1)
    caches = [make_cache(G, KV_HEADS, poison=False) for _ in range(2)]
    for cache in caches:
        cache.data.zero_()
    batch = StaticDecodeBatch(4, 4, G, caches[1])
    eager = inputs_of(step(0, {1: 5, 2: 6, 3: 7}, FORWARDS))
    static = eager
    for forward in range(FORWARDS):
        if forward:
            tokens = torch.tensor([9 + forward, 10, 11 + forward])
            eager, static = eager.next_forward(tokens), static.next_forward(tokens)
        assert batch.fits(static)
        batch.load(static)
        want = model.forward(eager, caches[0])
        got = model.forward(batch.inputs, caches[1])
        assert torch.equal(got[: eager.num_seqs], want)
    real = slice(0, caches[0].pad_page)
    assert torch.equal(caches[1].data[real], caches[0].data[real])


def options() -> ExecutorOptions:
    return ExecutorOptions(
        model="stand-in", num_kv_pages=G.num_kv_pages, page_size=G.page_size, max_num_seqs=G.max_num_seqs,
        max_num_batched_tokens=G.max_num_batched_tokens, max_model_len=G.max_model_len, kv_cache_dtype=G.kv_dtype,
        num_host_pages=G.num_host_pages, device="cpu",
    )


def run_forwards(cut_after: int | None, *, pipelined: bool = False) -> tuple[Result, int]:
    """A step of FORWARDS forwards through the model's thread (StepRunner), cut after `cut_after` of
    them as the link reports a CUT (None: not cut); its RESULT and the forwards the model ran.
    pipelined: in the order a CUDA device takes (each sample taken once the next forward is queued),
    the step answered by settle()."""
    model = StandInModel(0, 1)
    cache = make_cache(G, KV_HEADS, poison=False)
    cache.data.zero_()

    def is_cut(step: int) -> bool:
        return step == 5 and cut_after is not None and model.forward_calls >= cut_after

    runner = StepRunner(
        rank=0, world_size=1, model=model, cache=cache, options=options(), is_cut=is_cut, pipelined=pipelined
    )
    prepare = step(0, {1: 5, 2: 6, 3: 7}, FORWARDS)
    answers: list[tuple[int, Callable[[], Result] | None, bool]] = []
    none = np.zeros(0, dtype=np.int64)
    runner.run(StagedStep(5, prepare, inputs_of(prepare), none, none, None), lambda *a: answers.append(a))
    assert (answers == []) == pipelined and runner.open_step == (5 if pipelined else None)
    runner.settle(lambda *a: answers.append(a))
    [(answered, result, next_running)] = answers
    assert answered == 5 and not next_running and runner.open_step is None
    return result(), model.forward_calls


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_cut_step_ends_after_the_forward_running_and_says_how_many_ran(pipelined: bool) -> None:
    whole, calls = run_forwards(None, pipelined=pipelined)
    assert calls == FORWARDS and whole.token_ids.shape[0] == FORWARDS * 3
    for after in range(1, FORWARDS):
        cut, calls = run_forwards(after, pipelined=pipelined)
        assert calls == after
        assert cut.seq_ids.tolist() == whole.seq_ids.tolist()
        # The forwards that ran sampled what the whole step's first ones did.
        assert cut.token_ids.tolist() == whole.token_ids[: after * 3].tolist()
        assert cut.finite.shape[0] == cut.logprobs.shape[0] == after * 3


def test_the_pipelined_order_answers_what_the_cpus_order_does() -> None:
    at_once, _ = run_forwards(None)
    pipelined, _ = run_forwards(None, pipelined=True)
    for name in ("seq_ids", "token_ids", "logprobs", "finite", "top_token_ids", "top_logprobs"):
        assert np.array_equal(getattr(pipelined, name), getattr(at_once, name), equal_nan=name.endswith("logprobs")), name


def test_a_rank_that_does_not_sample_gets_every_input_but_the_samplers_parameters() -> None:
    """Ranks other than 0 stage no sampler rows (StepInputs.from_prepare(samples=False)); what the
    model and the link read must stay what rank 0 gets, forward after forward."""
    prepare = replace(step(0, {1: 11, 2: 12, 3: 13}, FORWARDS), seeds=np.array([7, -1, 9], dtype=np.int64))
    sampling = inputs_of(prepare)
    other = StepInputs.from_prepare(prepare, pad_page=G.num_kv_pages, page_size=G.page_size, device="cpu", samples=False)
    for forward in range(FORWARDS):
        for f in fields(StepInputs):
            ours, theirs = getattr(sampling, f.name), getattr(other, f.name)
            if f.metadata["pad"] is Pad.SAMPLER and f.name != "sample_seq_ids":
                assert len(theirs.temperature if f.name == "sampling" else theirs) == 0, f.name
                assert len(ours.temperature if f.name == "sampling" else ours) == 3, f.name
            elif f.metadata["pad"] is Pad.LATER:
                assert len(ours) == len(theirs) == FORWARDS - 1 - forward, (forward, f.name)
                for a, b in zip(ours, theirs):
                    assert all(np.array_equal(getattr(a, n), getattr(b, n)) for n in a.__slots__ if n != "sampling"), (forward, f.name)
                    assert len(a.sampling.temperature) == 3 and len(b.sampling.temperature) == 0, (forward, f.name)
            elif isinstance(ours, torch.Tensor):
                assert torch.equal(ours, theirs), (forward, f.name)
            elif isinstance(ours, np.ndarray):
                assert np.array_equal(ours, theirs), (forward, f.name)
            else:
                assert ours == theirs, (forward, f.name)
        if forward < FORWARDS - 1:
            tokens = torch.tensor([20 + forward, 30 + forward, 40 + forward])
            sampling, other = sampling.next_forward(tokens), other.next_forward(tokens)


def test_a_gpus_feedback_layout_feeds_what_the_cpus_host_arrays_feed() -> None:
    """The link stacks a GPU step's feedback rows over their sources (feedback_on_device), which
    StepRunner._feed reads on the device's path; a CPU's are read from the host arrays. Both, run
    here on the CPU, land the same tokens in the same rows: the device's path, which CI never runs
    on a device, cannot drift from the layout the link makes."""
    runner = StepRunner(rank=0, world_size=1, model=StandInModel(0, 1), cache=make_cache(G, KV_HEADS, poison=False), options=options())
    runner._samples.tokens = torch.tensor([40, 41, 42, 43])  # the step before's samples
    prepare = step(0, {1: 5, 2: 6, 3: 7})
    rows, sources = np.array([0, 2], dtype=np.int64), np.array([3, 1], dtype=np.int64)
    landed = []
    for on_device in (None, feedback_on_device(rows, sources, "cpu")):
        inputs = inputs_of(prepare)
        runner._feed(StagedStep(5, prepare, inputs, sources, rows, on_device)).land(inputs)
        landed.append(inputs.token_ids.tolist())
    assert landed[0] == landed[1] == [43, 6, 41]


def test_a_cpus_feed_reads_the_samples_own_array_and_lands_in_the_staged_one() -> None:
    """The CPU's feed takes no numpy view between two forwards (docs/control_plane.md, change 111):
    it reads the array the compiled pass wrote the sample into, and writes the array the link
    staged under the inputs' token_ids. Both must be the memory they stand for."""
    import executor.sampler as sampler

    runner = StepRunner(rank=0, world_size=1, model=StandInModel(0, 1), cache=make_cache(G, KV_HEADS, poison=False), options=options())
    sampled = step(0, {1: 5, 2: 6, 3: 7})
    inputs = inputs_of(sampled)
    rows = inputs.sample_seq_ids.shape[0]
    outputs = HostOutputs.frame(1, rows, inputs.sampling.host.most_logprobs)
    staged = StagedStep(4, sampled, inputs, np.zeros(0, np.int64), np.zeros(0, np.int64), None, outputs=outputs)
    logits = torch.full((rows, 64), -10.0)
    logits[torch.arange(rows), torch.tensor([40, 41, 42])] = 10.0  # greedy rows: tokens 40, 41, 42
    runner._sample(staged, inputs, logits, 0)
    if sampler._sampling is None:  # the passes draw into tensors of their own
        assert runner._samples.array is None
    else:
        assert np.shares_memory(runner._samples.array, runner._samples.tokens.numpy())
    assert runner._samples.tokens.tolist() == [40, 41, 42]

    fed = step(1, {1: 0, 2: 0, 3: 0})
    inputs = inputs_of(fed)
    staged_rows, sources = np.array([0, 2], dtype=np.int64), np.array([2, 0], dtype=np.int64)
    staged = StagedStep(5, fed, inputs, sources, staged_rows, None)
    assert np.shares_memory(staged.token_ids_host, inputs.token_ids.numpy())  # taken as it is staged
    feeding = runner._feed(staged)
    assert feeding.into is staged.token_ids_host
    feeding.land(inputs)
    assert inputs.token_ids.tolist() == [42, 0, 40]
    # Without feedback rows, or fed on the device, there is nothing to land on the host.
    assert StagedStep(5, fed, inputs, np.zeros(0, np.int64), np.zeros(0, np.int64), None).token_ids_host is None
    on_device = StagedStep(5, fed, inputs, sources, staged_rows, feedback_on_device(staged_rows, sources, "cpu"))
    assert on_device.token_ids_host is None
