"""Llama 3.1, Mistral (sliding window) and Qwen2 (q/k/v biases), HF and GGUF, against transformers.

Each case is a small random checkpoint written by transformers (tests/model/checkpoints.py); the
paged model runs tests.model.tp_worker's scenario (two prompts prefilled together, then batched
greedy decode) at TP=1 and TP=2, and every sampled row must match transformers' float32 logits of
the same tokens within ATOL/RTOL: fp32 throughout, so the only differences are summation orders.
The greedy tokens must be transformers' own argmax at every step. Then: what the loader refuses.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from executor.model import ModelLoadError, load_model
from executor.model import compiled as compiled_layers
from executor.model.config import UnsupportedModelError
from executor.model.load import open_source
from protocol.errors import TPRuntimeError
from tests.model.checkpoints import LLAMA3_SCALING, reference_logits, reference_model, run_ranks, write_gguf, write_hf
from tests.model.driver import Driver
from tests.model.tp_worker import PROMPTS, free_port, scenario

transformers = pytest.importorskip("transformers", reason="transformers is the reference")

ATOL = 1e-4
RTOL = 1e-4
CPU = torch.device("cpu")
# name -> (model_type, config overrides, file format)
CASES = {
    "llama3.1": ("llama", {"rope_parameters": {**LLAMA3_SCALING, "rope_theta": 10000.0}}, "hf"),
    "llama3.1-gguf": ("llama", {"rope_parameters": {**LLAMA3_SCALING, "rope_theta": 10000.0}}, "gguf"),
    "mistral-window": ("mistral", {"sliding_window": 5}, "hf"),
    "mistral-window-gguf": ("mistral", {"sliding_window": 5}, "gguf"),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}, "hf"),
    # 6 query heads over 3 KV groups: at TP=2 the biases split unevenly with their heads (2 + 1 groups).
    "qwen2-uneven-gguf": ("qwen2", {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}, "gguf"),
    # 1 KV head: at TP=2 both ranks hold it (and its k/v biases), each with half the query heads.
    "qwen2-replicated-kv": ("qwen2", {"num_key_value_heads": 1}, "hf"),
    # Qwen2's own window: layers from max_window_layers on attend to the last 4 positions only.
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}, "hf"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    root = tmp_path_factory.mktemp("architectures")
    made = {}
    for seed, (name, (model_type, overrides, kind)) in enumerate(CASES.items()):
        model = reference_model(model_type, seed=seed, **overrides)
        path = write_hf(root / name, model) if kind == "hf" else write_gguf(root / f"{name}.gguf", model)
        made[name] = (model, path)
    return made


def _expected(reference: torch.nn.Module, generated: dict[int, list[int]]) -> torch.Tensor:
    """transformers' logits at the rows the scenario samples, in its order: [steps * seqs, vocab]."""
    per_seq = {s: reference_logits(reference, PROMPTS[s] + generated[s]) for s in PROMPTS}
    rows = []
    for step in range(len(generated[0]) + 1):
        rows += [per_seq[s][len(PROMPTS[s]) - 1 + step] for s in PROMPTS]
    return torch.stack(rows)


def _check_against_reference(reference, logits: torch.Tensor, generated: dict[int, list[int]]) -> None:
    expected = _expected(reference, generated)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)
    # Teacher-forced on our tokens, transformers' greedy choice is our token at every step: its own
    # greedy decode would have produced the same sequence.
    ours = torch.tensor([generated[s] for s in PROMPTS]).t().reshape(-1)
    assert torch.equal(expected[: ours.shape[0]].argmax(dim=-1), ours)
    assert len(set(ours.tolist())) > 2, "greedy output should not be degenerate"


@pytest.mark.parametrize("name", list(CASES))
def test_tp1_matches_transformers(checkpoints, name):
    reference, path = checkpoints[name]
    model = load_model(str(path), rank=0, world_size=1, dtype=torch.float32, device=CPU)
    model_type, _, kind = CASES[name]
    assert model.config.architecture == ("llama" if (model_type, kind) == ("mistral", "gguf") else model_type)
    logits, generated = scenario(model)
    _check_against_reference(reference, torch.cat(logits), generated)


@pytest.mark.timeout(300)
def test_tp2_matches_transformers(checkpoints, tmp_path):
    names = list(CASES)
    outs = [tmp_path / name for name in names]
    for out in outs:
        out.mkdir()
    context = mp.start_processes(
        run_ranks,
        args=(2, [free_port() for _ in names], [str(checkpoints[n][1]) for n in names], [str(o) for o in outs]),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 240
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError("TP=2 ranks did not finish in time")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    for name, out in zip(names, outs):
        generated = {int(k): v for k, v in json.loads((out / "generated.json").read_text()).items()}
        _check_against_reference(checkpoints[name][0], torch.from_numpy(np.load(out / "logits.npy")), generated)


# -- the sliding window over the paged cache -------------------------------------------------------

PROMPT = [5, 70, 33, 99, 100, 101, 7, 250, 12, 13, 14, 400, 3, 77]


def test_the_window_matters_in_these_tests(checkpoints):
    """Without its window the Mistral case would compute other logits: the tests above see it."""
    reference, _ = checkpoints["mistral-window"]
    windowed = reference_logits(reference, PROMPT)
    reference.config.sliding_window = None
    try:
        full = reference_logits(reference, PROMPT)
    finally:
        reference.config.sliding_window = 5
    assert torch.allclose(windowed[:5], full[:5], atol=1e-5)
    assert (windowed[5:] - full[5:]).abs().max() > 0.1


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window"])
def test_window_over_chunked_prefill_and_mixed_steps(checkpoints, name):
    """Chunks ending mid-page with a past beyond the window, then a decode mixed with a prefill."""
    reference, path = checkpoints[name]
    model = load_model(str(path), rank=0, world_size=1, dtype=torch.float32, device=CPU)
    driver = Driver(model, page_size=4)
    rows = [driver.step([(0, PROMPT[:6], True)]), driver.step([(0, PROMPT[6:9], True)])]
    rows.append(driver.step([(0, PROMPT[9:], True)]))
    token = int(rows[-1].argmax())
    mixed = driver.step([(0, [token], True), (1, PROMPT[2:], True)])
    expected = reference_logits(reference, PROMPT + [token])
    torch.testing.assert_close(torch.cat(rows + [mixed[:1]]), expected[[5, 8, 13, 14]], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(mixed[1], reference_logits(reference, PROMPT[2:])[-1], atol=ATOL, rtol=RTOL)


def _poison_run(model, *, poison: bool, clear: bool):
    driver = Driver(model, page_size=8, poison=poison, clear=clear)
    logits, generated = driver.greedy({0: PROMPT[:5], 1: PROMPT[:11]}, 4)
    return torch.cat(logits), generated


def test_window_keeps_the_poison_proof(checkpoints):
    """Slots older than the window are masked like those past the end, and pages are still read
    whole: with clears a poisoned cache changes nothing; without, the stale slots show."""
    _, path = checkpoints["mistral-window"]
    model = load_model(str(path), rank=0, world_size=1, dtype=torch.float32, device=CPU)
    clean, clean_tokens = _poison_run(model, poison=False, clear=True)
    poisoned, poisoned_tokens = _poison_run(model, poison=True, clear=True)
    assert torch.isfinite(clean).all()
    assert torch.equal(poisoned, clean) and poisoned_tokens == clean_tokens
    unclear, _ = _poison_run(model, poison=True, clear=False)
    assert not torch.isfinite(unclear[:2]).any(dim=-1).any(), "every row reads a stale slot"


def test_a_model_mixing_windowed_and_full_layers_plans_a_library_for_each(checkpoints):
    """Qwen2's windowed layers get libraries of their own beside the full layers', for decode and
    mixed steps alike (the plan alone: the compiled test below builds a model of windowed layers)."""
    _, path = checkpoints["qwen2-window"]
    model = load_model(str(path), rank=0, world_size=1, dtype=torch.float32, device=CPU)
    driver = Driver(model, page_size=4)
    plan = compiled_layers._plan(model.layers, model.shapes, 1, driver.cache)
    assert [r.kind for r in plan] == ["decode", "mixed"]
    for r in plan:
        assert [(spec.window, spec.qkv_bias) for (spec,) in r.layers] == [(None, True), (4, True)]


@pytest.fixture(scope="module")
def windowed_qwen2(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """Qwen2 with every layer windowed (max_window_layers 0), q/k/v biases and all: one library for
    decode steps and one for mixed steps. A full layer would add two more, whose bias code the
    windowed ones run too."""
    model = reference_model("qwen2", seed=len(CASES), use_sliding_window=True, sliding_window=4, max_window_layers=0)
    return model, write_hf(tmp_path_factory.mktemp("qwen2-windowed"), model)


@pytest.mark.timeout(1200)  # builds two libraries: decode and mixed, every layer windowed
def test_biased_and_windowed_models_run_compiled(windowed_qwen2):
    """Changed meaning on purpose: with one decoder layer, Qwen2's biases and its windowed layers
    run on the compiled layers like any other model (they used to decode eager). Every step's
    runner is asserted, and its logits held to transformers' as the eager tests hold them."""
    reference, path = windowed_qwen2
    model = load_model(str(path), rank=0, world_size=1, dtype=torch.float32, device=CPU, compile_mode="wait")
    assert model.config.windowed_layers == (0, 1) and model.config.sliding_window == 4
    driver = Driver(model, page_size=4)
    prompt = PROMPT[:9]
    rows = [driver.step([(0, prompt, True)])]
    assert driver.runner.last_runner == "eager", "a prefill chunk alone: the causal kernel"
    tokens = prompt + [int(rows[-1].argmax())]
    for _ in range(3):
        rows.append(driver.step([(0, tokens[-1:], True)]))
        assert driver.runner.last_runner == "compiled", "a decode step"
        tokens.append(int(rows[-1].argmax()))
    expected = reference_logits(reference, tokens[:-1])
    torch.testing.assert_close(torch.cat(rows), expected[len(prompt) - 1 :], atol=ATOL, rtol=RTOL)
    # A decode beside another prompt's chunk: the mixed library, held to the reference too.
    mixed = driver.step([(0, tokens[-1:], True), (1, PROMPT[2:9], True)])
    assert driver.runner.last_runner == "compiled", "a mixed step"
    torch.testing.assert_close(mixed[0], reference_logits(reference, tokens)[-1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(mixed[1], reference_logits(reference, PROMPT[2:9])[-1], atol=ATOL, rtol=RTOL)
    layers = driver.runner.compiled(driver.cache)
    assert [(spec.step, spec.window, spec.qkv_bias) for spec in layers.specs] == [("decode", 4, True), ("mixed", 4, True)]


# -- refusals ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return write_hf(tmp_path_factory.mktemp("llama"), reference_model("llama"))


def _with_config(source: Path, directory: Path, change) -> Path:
    directory.mkdir()
    for file in source.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


REFUSED_CONFIGS = {
    "unknown architecture": (
        lambda c: c.update(architectures=["GemmaForCausalLM"], model_type="gemma"),
        r"architecture 'GemmaForCausalLM' is not supported \(supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM\)",
    ),
    "unknown model_type": (lambda c: (c.pop("architectures"), c.update(model_type="qwen3")), r"model_type 'qwen3' is not supported"),
    "no architecture at all": (lambda c: (c.pop("architectures"), c.pop("model_type")), "names neither architectures nor model_type"),
    "class and type disagree": (lambda c: c.update(model_type="qwen2"), "has model_type 'llama', but the config says 'qwen2'"),
    "a head for another task": (lambda c: c.update(architectures=["LlamaForSequenceClassification"]), "is not supported"),
    "yarn rope": (
        lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
        r"rope scaling type 'yarn' is not supported \(supported: default, llama3\)",
    ),
    "linear rope, legacy key": (
        lambda c: (c.pop("rope_parameters"), c.update(rope_scaling={"type": "linear", "factor": 2.0})),
        "rope scaling type 'linear' is not supported",
    ),
    "dynamic rope": (lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "'dynamic' is not supported"),
    "partial rotary": (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    "gelu": (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    "quantized": (lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}), r"quantized checkpoints \(gptq\)"),
    "llama attention bias": (lambda c: c.update(attention_bias=True), "Llama with attention_bias true"),
    "llama mlp bias": (lambda c: c.update(mlp_bias=True), "Llama with mlp_bias true"),
    "pretraining_tp": (lambda c: c.update(pretraining_tp=2), "pretraining_tp 2"),
    "tied config, separate head": (lambda c: c.update(tie_word_embeddings=True), "lm_head.weight differs from the embedding"),
}


@pytest.mark.parametrize("case", list(REFUSED_CONFIGS))
def test_refused_hf_configs(llama_dir, tmp_path, case):
    change, message = REFUSED_CONFIGS[case]
    directory = _with_config(llama_dir, tmp_path / "model", change)
    with pytest.raises(UnsupportedModelError, match=message):
        open_source(directory)


def test_untied_config_without_a_head_is_refused(checkpoints, tmp_path):
    _, qwen2 = checkpoints["qwen2"]  # tied: no lm_head.weight in the file
    directory = _with_config(qwen2, tmp_path / "model", lambda c: c.update(tie_word_embeddings=False))
    with pytest.raises(ModelLoadError, match="tie_word_embeddings is false but lm_head.weight is missing"):
        open_source(directory)


def test_qwen2_weights_labelled_llama_are_refused(checkpoints, tmp_path):
    """The issue's case: loaded as Llama, Qwen2's biases would be dropped without a word."""
    _, qwen2 = checkpoints["qwen2"]
    directory = _with_config(qwen2, tmp_path / "model", lambda c: c.update(architectures=["LlamaForCausalLM"], model_type="llama"))
    with pytest.raises(UnsupportedModelError, match=r"model.layers.0.self_attn.k_proj.bias.*running without them"):
        open_source(directory)


def test_refusals_are_runtime_errors():
    assert issubclass(UnsupportedModelError, ModelLoadError) and issubclass(ModelLoadError, TPRuntimeError)


def test_cli_refuses_with_exit_2_and_a_sentence(llama_dir, tmp_path, capsys):
    from tp_runtime.cli import main

    directory = _with_config(llama_dir, tmp_path / "model", lambda c: c.update(architectures=["MixtralForCausalLM"]))
    assert main(["generate", "--model", str(directory), "--device", "cpu", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tp-runtime: error: ") and "architecture 'MixtralForCausalLM' is not supported" in err


@pytest.fixture(scope="module")
def tiny_llama() -> torch.nn.Module:
    return reference_model("llama", num_hidden_layers=1)


REFUSED_GGUF = {
    "mixture of experts": ({"metadata": {"llama.expert_count": 8}}, r"mixture-of-experts models \(8 experts\)"),
    "linear rope": (
        {"metadata": {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}},
        r"rope scaling 'linear' \(factor 4.0\) is not supported",
    ),
    "factor without a type": ({"metadata": {"llama.rope.scaling.factor": 2.0}}, "rope scaling 'linear'"),
    "yarn rope": ({"metadata": {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}}, "rope scaling 'yarn'"),
    "output bias": ({"extra": {"blk.0.attn_output.bias": np.zeros(64, np.float32)}}, r"does not use \(blk.0.attn_output.bias\)"),
    "q bias on llama": ({"extra": {"blk.0.attn_q.bias": np.zeros(64, np.float32)}}, "blk.0.attn_q.bias"),
}


@pytest.mark.parametrize("case", list(REFUSED_GGUF))
def test_refused_gguf(tiny_llama, tmp_path, case):
    options, message = REFUSED_GGUF[case]
    path = write_gguf(tmp_path / "model.gguf", tiny_llama, **options)
    with pytest.raises(UnsupportedModelError, match=message):
        open_source(path)


def test_refused_gguf_architecture(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"GGUF architecture 'gemma' is not supported \(supported: llama, qwen2\)"):
        open_source(tmp_path / "gemma.gguf")
