"""Every runner (executor/model/runner.py) against the eager one: the compiled layers
(executor/model/compiled.py) give eager's logits on decode, mixed and prefill steps, and each step
says which runner served it; their promise to the clearing rule on every kind of step; and their
disk cache: keyed by what the code depends on, loaded on a second start without building, built by
`auto` only after enough eager steps, never retried after a failure. (CUDA graphs are the third
runner: scripts/device_check.sh runs them against eager on a GPU; tests/executor/test_graph_padding.py
checks their padding on the CPU.)

Two libraries are built for the whole module (a minute or two on 2 cores), a decode one and a mixed
one: a tiny GGUF whose QKV rows (16 query heads and 2 KV heads of 6) do not fit the int4 kernel, so
that at `int4` its layers run the dense custom op and the int4 kernel in one library. The SmolLM2
and TP=2 cases build more and are marked slow."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from executor import disk_cache
from executor.model import aot_layer, compiled, default_model_path, kernel_cache, load_model
from executor.model.aot_layer import LayerSpec
from tests.model.driver import Driver
from tests.model.tp_worker import PROMPTS, run_tp, scenario
from tests.tiny_models import write_tiny_gguf

CPU = torch.device("cpu")
# The stated tolerance between runners: bf16 logits of the tiny model are O(1), and the compiled
# layers sum in other orders (Inductor's fused RMSNorm and elementwise code; a prefill chunk through
# the masked kernel rather than the causal one): bf16 rounding apart.
LOGIT_ATOL = 0.05
DECODE_STEPS = 6
# The module fixture compiles a library: ~30-70 s on 2 cores, past 600 s on a machine at load 15.
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", num_heads=16, num_kv_heads=2)


def load(path, mode, weight_format="int4", dtype=torch.bfloat16, **kwargs):
    return load_model(str(path), rank=0, world_size=1, dtype=dtype, device=CPU, weight_format=weight_format, compile_mode=mode, **kwargs)


def greedy(model, **driver):
    driver = Driver(model, num_kv_pages=32, page_size=4, kv_dtype="bf16", **driver)
    logits, tokens = driver.greedy(PROMPTS, DECODE_STEPS)
    return driver, logits, tokens


@pytest.fixture(scope="module")
def built(tiny_path):
    """The tiny model with its libraries built (`wait`), and the eager model beside it."""
    model = load(tiny_path, "wait")
    driver, logits, tokens = greedy(model)
    assert driver.runner.last_runner == "compiled"
    layers = driver.runner.compiled(driver.cache)
    assert [(spec.step, spec.matmuls) for spec in layers.specs] == [
        ("decode", ("dense", "int4", "int4", "int4")), ("mixed", ("dense", "int4", "int4", "int4")),
    ]
    return model, logits, tokens


# (steps, the runner that serves each): a prefill chunk alone (eager: the causal kernel skips half
# its scores), decodes beside a chunk, a decode step, and two chunks in one step, which no library
# covers.
SCRIPT = [
    ([(0, [5, 6, 7, 8, 9], True)], "eager"),
    ([(0, [11], True), (1, [3, 4, 5], True)], "compiled"),
    ([(0, [12], True), (1, [13], True)], "compiled"),
    ([(0, [14, 15], True), (1, [16, 17, 18], True)], "eager"),
    ([(0, [19], True), (1, [20], True), (2, [1, 2, 3, 4, 5, 6, 7], False)], "compiled"),
]


def test_every_runner_gives_the_eager_logits_and_says_which_served_each_step(tiny_path, built):
    """Decode, mixed and prefill steps through the compiled layers against the same steps eagerly,
    within LOGIT_ATOL; each step's runner is asserted, so a silent fall-back to eager fails."""
    fast = Driver(built[0], num_kv_pages=32, page_size=4, kv_dtype="bf16")
    eager = Driver(load(tiny_path, "off"), num_kv_pages=32, page_size=4, kv_dtype="bf16")
    for chunks, runner in SCRIPT:
        logits, expected = fast.step(chunks), eager.step(chunks)
        assert (fast.runner.last_runner, eager.runner.last_runner) == (runner, "eager"), chunks
        torch.testing.assert_close(logits, expected, atol=LOGIT_ATOL, rtol=0)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_compiled_greedy_generation_gives_the_eager_tokens(tiny_path, built):
    _, logits, tokens = built
    _, eager_logits, eager_tokens = greedy(load(tiny_path, "off"))
    torch.testing.assert_close(torch.cat(logits), torch.cat(eager_logits), atol=LOGIT_ATOL, rtol=0)
    assert tokens == eager_tokens


def _poison_past_the_end(driver: Driver, seq_id: int, part: int) -> None:
    """NaN (every layer's K or V) in the slot just past where the sequence's next token goes: past
    its end at the next decode step, in its last, partly filled page; masked, read all the same."""
    seq = driver.seqs[seq_id]
    slot = len(seq.tokens) + 1
    assert slot // driver.page_size < len(seq.pages) and slot % driver.page_size, "a slot of a partly filled page"
    driver.cache.data[seq.pages[slot // driver.page_size], :, part, slot % driver.page_size] = float("nan")


@pytest.mark.parametrize("mode", ["off", "wait"], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("part", [0, 1], ids=["k", "v"])
def test_every_runner_reads_the_last_page_whole(tiny_path, built, mode, kind, part):
    """A decode row (in a decode step, or beside a prefill chunk) reads its last, partly filled
    page whole: a NaN past its end reaches its logits, on the eager and the compiled runner."""
    model = built[0] if mode == "wait" else load(tiny_path, "off")
    for poisoned in (False, True):
        driver = Driver(model, num_kv_pages=32, page_size=4, kv_dtype="bf16")
        driver.step([(0, [5, 6, 7, 8, 9], True), (1, [3, 4], True)])
        if poisoned:
            _poison_past_the_end(driver, 0, part)
        second = [(1, [12], True)] if kind == "decode" else [(1, [12, 13, 14], True)]
        logits = driver.step([(0, [11], True), *second])
        assert driver.runner.last_runner == ("compiled" if mode == "wait" else "eager")
        # Only the poisoned sequence is hit; without the poison (the negative control) neither is.
        assert torch.isnan(logits[0]).all().item() is poisoned
        assert torch.isfinite(logits[1]).all()


@pytest.mark.parametrize("part", [0, 1], ids=["k", "v"])
def test_a_compiled_prefill_chunk_reads_the_rest_of_its_last_page(built, part):
    """A chunk's rows read its last page whole too: a NaN past the chunk's end reaches them, and
    not the decode beside it."""
    for poisoned in (False, True):
        driver = Driver(built[0], num_kv_pages=32, page_size=4, kv_dtype="bf16")
        driver.step([(0, [5, 6, 7, 8, 9], True), (1, [3, 4], True)])
        if poisoned:
            # The chunk below writes slots 5 and 6; slot 7 ends its last page, past its end.
            page = driver.seqs[0].pages[1]
            driver.cache.data[page, :, part, 3] = float("nan")
        logits = driver.step([(1, [12], True), (0, [10, 11], True)])
        assert driver.runner.last_runner == "compiled"
        assert torch.isnan(logits[1]).all().item() is poisoned
        assert torch.isfinite(logits[0]).all()


def test_poisoned_cache_with_clears_decodes_as_a_clean_one(built):
    model, logits, tokens = built
    driver, poisoned_logits, poisoned_tokens = greedy(model, poison=True)
    assert poisoned_tokens == tokens
    torch.testing.assert_close(torch.cat(poisoned_logits), torch.cat(logits), atol=0, rtol=0)
    # The negative control: with the clears skipped the decode steps see the poison.
    _, skipped, _ = greedy(model, poison=True, clear=False)
    assert not all(torch.isfinite(step).all() for step in skipped[1:])


def test_a_second_start_loads_the_library_without_building(tiny_path, built, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("a cached library was built again")

    monkeypatch.setattr(kernel_cache, "start_build", no_build)
    model = load(tiny_path, "auto")
    driver, logits, _ = greedy(model)
    assert driver.runner.last_runner == "compiled"
    torch.testing.assert_close(torch.cat(logits), torch.cat(built[1]), atol=0, rtol=0)


def _spec(**changes) -> LayerSpec:
    fields = dict(
        part="layer", step="decode", hidden=576, q_heads=9, kv_heads=3, head_dim=64, ffn=1536, rms_eps=1e-5,
        num_layers=30, page_size=16, dtype="bfloat16", kv_dtype="bfloat16", matmuls=("int4",) * 4,
        qkv_bias=False, window=None, min_rows=1, max_rows=8, threads=2,
    )
    return LayerSpec(**{**fields, **changes})


def test_the_cache_key_changes_with_the_model_the_shapes_the_formats_torch_and_the_cpu(monkeypatch):
    key = _spec().key()
    assert _spec().key() == key
    changed = [
        _spec(hidden=960), _spec(q_heads=8), _spec(kv_heads=1), _spec(head_dim=96), _spec(ffn=2560),
        _spec(rms_eps=1e-6), _spec(num_layers=24), _spec(page_size=32), _spec(dtype="float32"),
        _spec(kv_dtype="float8_e4m3fn"), _spec(matmuls=("dense",) * 4),
        _spec(min_rows=9, max_rows=1 << 14), _spec(threads=1), _spec(part="attention"), _spec(step="mixed"),
        _spec(qkv_bias=True), _spec(window=4096),
    ]
    assert len({spec.key() for spec in changed} | {key}) == len(changed) + 1
    identity = dict(disk_cache.cpu_identity())
    for field, value in (("torch", "2.99.0"), ("cpu_flags", "0" * 16), ("cpu", "another CPU")):
        monkeypatch.setattr(aot_layer, "cpu_identity", lambda f=field, v=value: {**identity, f: v})
        assert _spec().key() != key, field
    monkeypatch.setattr(aot_layer, "cpu_identity", lambda: identity)
    monkeypatch.setattr(aot_layer, "_SOURCE_DIGEST", "another version of the decoder layer")
    assert _spec().key() != key


def test_a_built_cache_serves_no_other_model_shape_nor_another_torch(tiny_path, tmp_path_factory, built, monkeypatch):
    """End to end through the loader: with the module's library on disk, a model of another shape
    (a wider FFN) and the same model under another torch version find nothing to load, and run
    eager."""
    monkeypatch.setattr(kernel_cache, "start_build", lambda *a, **k: pytest.fail("auto built at start-up"))
    driver, _, _ = greedy(load(tiny_path, "auto"))
    assert driver.runner.last_runner == "compiled"
    wider = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "wider.gguf", num_heads=16, num_kv_heads=2, intermediate_size=256)
    driver, _, _ = greedy(load(wider, "auto"))
    assert driver.runner.last_runner == "eager"
    identity = dict(disk_cache.cpu_identity())
    monkeypatch.setattr(aot_layer, "cpu_identity", lambda: {**identity, "torch": "2.99.0"})
    driver, _, tokens = greedy(load(tiny_path, "auto"))
    assert driver.runner.last_runner == "eager"
    assert tokens == built[2]


def test_auto_builds_in_the_background_once_enough_eager_decoding_is_spent(tiny_path, tmp_path, monkeypatch):
    monkeypatch.setenv("TP_RUNTIME_CACHE_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setattr(compiled, "REPORT_EVERY_S", 0.2)
    monkeypatch.setattr(compiled, "BUILD_AFTER_EAGER_S", 1.0)
    builds = []
    monkeypatch.setattr(kernel_cache, "start_build", lambda specs, *, background: builds.append((specs, background)))
    model = load(tiny_path, "auto")
    driver = Driver(model, num_kv_pages=32, page_size=4, kv_dtype="bf16")
    driver.step([(0, [5, 6, 7], True), (1, [8, 9], True)])  # two chunks: no library would serve it
    layers = driver.runner.compiled(driver.cache)
    assert driver.runner.last_runner == "eager" and not builds
    layers.eager_ran(0.3)
    assert json.loads(layers._usage.read_text())["eager_decode_s"] == pytest.approx(0.3)
    # Another process of the same shapes adds to the same count.
    compiled.CompiledLayers.attach(model.layers, model.shapes, 1, driver.cache, "auto").eager_ran(0.5)
    assert not builds
    layers.eager_ran(0.1)
    assert not builds, "time not reported yet counts once reported"
    layers.eager_ran(0.3)
    assert builds == [(layers.specs, True)]
    layers.eager_ran(10.0)
    assert len(builds) == 1, "one build per process"


def test_a_build_that_failed_is_not_retried(tiny_path, tmp_path, monkeypatch):
    monkeypatch.setenv("TP_RUNTIME_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_cache, "start_build", lambda *a, **k: pytest.fail("a failed build was retried"))
    model = load(tiny_path, "wait")
    driver = Driver(model, num_kv_pages=32, page_size=4, kv_dtype="bf16")
    specs = compiled.CompiledLayers(model.layers, 1, compiled._plan(model.layers, model.shapes, 1, driver.cache), "wait").specs
    for spec in specs:
        disk_cache.write_atomically(kernel_cache.failure_log(spec), b"compiler error\n")
    driver.greedy({0: [5, 6, 7]}, 2)
    assert driver.runner.last_runner == "eager"


QUESTIONS = [
    "What is 2+2?", "Name the capital of the United States.", "What color is the sky?", "Who wrote Hamlet?",
    "How many legs does a spider have?", "What is the boiling point of water?", "Translate 'hello' to French.",
    "What is the largest planet?", "Give me a synonym for happy.", "What is 10 times 10?",
    "Which ocean is the largest?", "What do bees make?",
]


@pytest.mark.slow
def test_smollm2_compiled_is_as_close_to_fp32_as_eager_and_answers_alike():
    """2 rows run the int4 library, 12 the dense one (the fixed probe's crossover is 8)."""
    from tp_runtime.chat import render_chat
    from tp_runtime.tokenizer import Tokenizer

    path = default_model_path()
    tokenizer = Tokenizer.from_model_path(path)
    prompts = {
        seq: tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": q}]), add_special_tokens=False)
        for seq, q in enumerate(QUESTIONS)
    }
    eager, built = load(path, "off", weight_format="mixed"), load(path, "wait", weight_format="mixed")
    reference = load(path, "off", weight_format="dense", dtype=torch.float32)
    for rows in (2, len(prompts)):
        batch = {seq: prompts[seq] for seq in range(rows)}
        eager_logits, tokens = Driver(eager, num_kv_pages=200, page_size=16, kv_dtype="bf16").greedy(batch, 16)
        _, compiled_tokens = Driver(built, num_kv_pages=200, page_size=16, kv_dtype="bf16").greedy(batch, 16)
        # One page per sequence: the probe's one-token step needs `rows` pages.
        probe = Driver(built, num_kv_pages=max(8, rows), page_size=16, kv_dtype="bf16")
        probe.step([(seq, [1], True) for seq in range(rows)])
        assert probe.runner.last_runner == "compiled"
        # The canonical answers (FACTS.md) come out the same; a prompt whose eager choice is a near
        # tie may go either way, as it does between batch sizes in eager alone.
        for seq in (0, 1):
            assert compiled_tokens[seq] == tokens[seq], QUESTIONS[seq]
        assert tokenizer.decode(compiled_tokens[0]).startswith("The answer to this classic math problem is 4.")

        def forced(model, kv_dtype):  # every step on eager's tokens, so that the logits compare
            driver = Driver(model, num_kv_pages=200, page_size=16, kv_dtype=kv_dtype)
            driver.step([(seq, prompt, True) for seq, prompt in batch.items()])
            return torch.cat([driver.step([(seq, [tokens[seq][step]], True) for seq in batch]) for step in range(16)])

        truth, compiled_logits = forced(reference, "fp32"), forced(built, "bf16")
        rms = lambda logits: (logits - truth).pow(2).mean().sqrt().item()  # noqa: E731
        # bf16 logits of SmolLM2 (up to ~40) carry ~0.09 rms of rounding either way: the compiled
        # layers sum in other orders, not less exactly.
        assert rms(compiled_logits) <= 1.1 * rms(torch.cat(eager_logits[1:]))


@pytest.mark.slow
def test_compiled_tp2_matches_compiled_tp1(tiny_path, tmp_path):
    expected_logits, expected_tokens = scenario(load(tiny_path, "wait"))
    run_tp(tiny_path, tmp_path, world_size=2, dtype="bf16", weight_format="int4", compile_mode="wait", timeout_s=600)
    logits = np.load(tmp_path / "logits.npy")
    np.testing.assert_allclose(logits, torch.cat(expected_logits).float().numpy(), atol=LOGIT_ATOL, rtol=0)
    generated = {int(k): v for k, v in json.loads((tmp_path / "generated.json").read_text()).items()}
    assert generated == expected_tokens
