"""fp8-e4m3 KV cache scales (executor/kv_scales.py): checkpoint names, calibration, the flags, the
clearing rule with scales, agreement across TP ranks, and the quality measured on SmolLM2.

The quality bound (test_smollm2_perplexity_...): over tests/data/perplexity.txt (413 tokens) with
bf16 weights and activations, fp8 with calibrated scales stays within 2% of the bf16 cache's
perplexity and 0.03 nats of mean KL divergence per token (measured: +0.87%, 0.0151; docs/model.md).
Against scale 1.0 it is no worse where the scales act, the error of every layer's stored K and V,
and end to end within the rounding noise that any change of scale brings on this model (KL moved
between 0.0131 and 0.0186 over six uniform scales): at most 1.3x scale 1.0's KL.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from executor.cache import KVCache
from executor.kv_scales import (
    K_RANGE,
    V_RANGE,
    KVScaleError,
    KVScales,
    ScaleCalibration,
    cache_scales,
    checkpoint_scales,
    parse_scales_option,
    resolve_scales,
)
from executor.model import ModelLoadError, default_model_path, load_model
from tests.model.driver import Driver
from tests.tiny_models import write_tiny_llama
from tp_runtime import cli
from tp_runtime.cli import checks
from tp_runtime.config import ConfigError, RuntimeConfig

CPU = torch.device("cpu")
PROMPT = [5, 70, 33, 99, 100, 101, 7, 250, 12, 13, 14, 400, 3, 77]


def _cache(**overrides) -> KVCache:
    options = dict(num_kv_pages=8, page_size=4, num_layers=2, num_kv_heads=2, head_dim=8, kv_dtype="fp8-e4m3", device=CPU)
    return KVCache(**{**options, **overrides})


def _read_back(cache: KVCache, layer: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = cache.key_value(layer)
    k_scale, v_scale = cache.layer_scales(layer)
    return k[page].float() * k_scale, v[page].float() * v_scale


# -- options and checkpoint names ------------------------------------------------------------------


def test_scales_option_parses_sources_and_numbers():
    assert [parse_scales_option(t) for t in ("auto", "checkpoint", "calibrate", "0.05")] == [
        "auto", "checkpoint", "calibrate", 0.05,
    ]
    for bad in ("0", "-1", "nan", "inf", "ones"):
        with pytest.raises(KVScaleError, match="--kv-cache-scales"):
            parse_scales_option(bad)


def test_resolution_prefers_the_checkpoint_and_calibrates_without_one():
    found = KVScales((0.5, 0.25), (0.125, 1.0), "checkpoint")
    assert resolve_scales("auto", found, 2) is found
    assert resolve_scales("auto", None, 2) is None
    assert resolve_scales("calibrate", found, 2) is None
    assert resolve_scales(2.0, found, 2) == KVScales.uniform(2, 2.0)
    with pytest.raises(KVScaleError, match="has no KV-cache scales"):
        resolve_scales("checkpoint", None, 2)
    assert cache_scales("auto", "/no/such/model.gguf", 2, 1, "bf16") is None
    assert isinstance(cache_scales("auto", "/no/such/model.gguf", 2, 1, "fp8-e4m3"), ScaleCalibration)


def _checkpoint(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    directory = write_tiny_llama(tmp_path / "model", num_layers=2)
    save_file(tensors, str(directory / "kv_scales.safetensors"))
    return directory


@pytest.mark.parametrize(
    ("k_name", "v_name"),
    [
        ("self_attn.k_scale", "self_attn.v_scale"),
        ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
        ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
    ],
    ids=["vllm", "compressed-tensors", "modelopt"],
)
def test_checkpoint_scales_are_read_under_vllms_names(tmp_path, k_name, v_name):
    tensors = {}
    for layer in range(2):
        tensors[f"model.layers.{layer}.{k_name}"] = torch.tensor(0.5 + layer)
        tensors[f"model.layers.{layer}.{v_name}"] = torch.tensor([0.25 * (layer + 1)])
    directory = _checkpoint(tmp_path, tensors)
    assert checkpoint_scales(directory, 2) == KVScales((0.5, 1.5), (0.25, 0.5), "checkpoint")
    # The model loads beside them, and a cache built for it stores with them.
    model = load_model(str(directory), rank=0, world_size=1, dtype=torch.float32, device=CPU)
    scales = cache_scales("auto", directory, model.config.num_layers, 1, "fp8-e4m3")
    driver = Driver(model, page_size=4, kv_dtype="fp8-e4m3", kv_scales=scales)
    assert torch.isfinite(driver.step([(0, PROMPT, True)])).all()
    assert driver.cache.scales.tolist() == [[0.5, 0.25], [1.5, 0.5]]


def test_the_deprecated_single_kv_scale_serves_k_and_v(tmp_path):
    directory = _checkpoint(tmp_path, {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(0.75) for i in range(2)})
    assert checkpoint_scales(directory, 2) == KVScales.uniform(2, 0.75, "checkpoint")


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"model.layers.0.self_attn.k_scale": torch.tensor(1.0), "model.layers.0.self_attn.v_scale": torch.tensor(1.0)}, "not for layers \\[1\\]"),
        ({f"model.layers.{i}.self_attn.{p}_scale": torch.ones(3) for i in range(2) for p in "kv"}, "per-head"),
        ({f"model.layers.{i}.self_attn.{p}_scale": torch.tensor(-1.0) for i in range(2) for p in "kv"}, "finite and positive"),
    ],
    ids=["some-layers", "per-head", "negative"],
)
def test_checkpoint_scales_that_cannot_be_used_are_refused(tmp_path, tensors, message):
    with pytest.raises(KVScaleError, match=message):
        checkpoint_scales(_checkpoint(tmp_path, tensors), 2)


def test_a_checkpoint_without_scales_and_a_gguf_have_none(tmp_path):
    assert checkpoint_scales(write_tiny_llama(tmp_path / "plain"), 2) is None
    assert checkpoint_scales(tmp_path / "plain" / "model.safetensors", 2) is None


# -- the command line --------------------------------------------------------------------------------


def _args(*argv: str):
    return cli.build_parser().parse_args(["serve", "--model", "/m/model.gguf", *argv])


def test_vllms_fp8_spellings_and_calculate_kv_scales_are_accepted():
    for spelling in ("fp8", "fp8_e4m3", "fp8-e4m3"):
        config = cli.config_from_args(_args("--kv-cache-dtype", spelling))
        assert (config.kv_cache_dtype, config.kv_cache_scales) == ("fp8-e4m3", "auto")
    assert cli.config_from_args(_args("--kv-cache-dtype", "bfloat16")).kv_cache_dtype == "bf16"
    assert cli.config_from_args(_args("--kv-cache-dtype", "fp8", "--calculate-kv-scales")).kv_cache_scales == "calibrate"
    assert cli.config_from_args(_args("--kv-cache-dtype", "fp8", "--kv-cache-scales", "0.5")).kv_cache_scales == "0.5"
    with pytest.raises(ConfigError, match="contradicts"):
        cli.config_from_args(_args("--calculate-kv-scales", "--kv-cache-scales", "1.0"))


def test_an_fp8_format_that_is_not_e4m3_is_refused_in_one_sentence(capsys):
    with pytest.raises(SystemExit) as exit_:
        _args("--kv-cache-dtype", "fp8_e5m2")
    assert exit_.value.code == cli.EXIT_USAGE
    assert "only e4m3 fp8 is supported" in capsys.readouterr().err


def test_scale_options_are_checked_before_any_rank_starts(tmp_path):
    directory = write_tiny_llama(tmp_path / "plain")
    with pytest.raises(ConfigError, match="applies to an fp8 KV cache"):
        checks._check_kv_scales(RuntimeConfig(model=str(directory), dtype="fp32", kv_cache_scales="calibrate"))
    with pytest.raises(ConfigError, match="has no KV-cache scales"):
        checks._check_kv_scales(RuntimeConfig(model=str(directory), dtype="fp32", kv_cache_dtype="fp8-e4m3", kv_cache_scales="checkpoint"))
    with pytest.raises(ConfigError, match="finite positive number"):
        checks._check_kv_scales(RuntimeConfig(model=str(directory), kv_cache_dtype="fp8-e4m3", kv_cache_scales="-2"))
    checks._check_kv_scales(RuntimeConfig(model=str(directory), dtype="fp32", kv_cache_dtype="fp8-e4m3"))


# -- calibration and the clearing rule ---------------------------------------------------------------


def test_calibration_sets_power_of_two_scales_from_the_first_armed_write_and_freezes_them():
    cache = _cache(scales=ScaleCalibration(2))
    cache.clear_pages(np.arange(8, dtype=np.int32))
    assert cache.calibration_pending and not cache.calibrating
    cache.begin_calibration()
    k = torch.linspace(-30.0, 30.0, 16).view(1, 2, 8)
    v = torch.linspace(-0.3, 0.3, 16).view(1, 2, 8)
    for layer in range(2):
        cache.write(layer, torch.tensor([1]), torch.tensor([0]), k * (layer + 1), v)
    assert not cache.calibration_pending and not cache.calibrating
    # 30 / 200 -> 0.25 (the power of two at or above), 60 / 200 -> 0.5, 0.3 / 100 -> 2^-8.
    assert cache.scales.tolist() == [[0.25, 2.0**-8], [0.5, 2.0**-8]]
    assert 30.0 / 0.25 <= K_RANGE and 0.3 / 2.0**-8 <= V_RANGE
    # Frozen: a later, larger write keeps them (and clips only past 448 x scale).
    cache.write(0, torch.tensor([2]), torch.tensor([0]), k * 2, v * 2)
    assert cache.scales.tolist() == [[0.25, 2.0**-8], [0.5, 2.0**-8]]
    keys, values = _read_back(cache, 0, 2)
    torch.testing.assert_close(keys[0], (k * 2)[0], rtol=2.0**-4, atol=0)
    torch.testing.assert_close(values[0], (v * 2)[0], rtol=2.0**-4, atol=0)


def test_calibrated_scales_keep_large_values_that_scale_one_clips_and_small_ones_it_flushes():
    k = torch.tensor([1000.0, -700.0, 3.0, 0.5]).repeat(4).view(1, 2, 8)
    v = torch.tensor([2e-4, -1e-3, 3e-3, 1e-5]).repeat(4).view(1, 2, 8)
    errors = {}
    for name, scales in (("unit", None), ("calibrated", ScaleCalibration(2))):
        cache = _cache(scales=scales)
        cache.clear_pages(np.arange(8, dtype=np.int32))
        if cache.calibration_pending:
            cache.begin_calibration()
        for layer in range(2):
            cache.write(layer, torch.tensor([3]), torch.tensor([1]), k, v)
        keys, values = _read_back(cache, 0, 3)
        errors[name] = ((keys[1] - k[0]).abs().max() / 1000, ((values[1] - v[0]).abs() / v[0].abs()).max())
    assert errors["unit"][0] > 0.5 and errors["calibrated"][0] < 2.0**-4  # 1000 clipped to 448 at scale 1
    assert errors["unit"][1] > 0.2 and errors["calibrated"][1] < 2.0**-4  # subnormal or zero at scale 1


def test_calibration_counts_nothing_measured_as_scale_one():
    cache = _cache(scales=ScaleCalibration(2))
    cache.begin_calibration()
    cache.write(0, torch.tensor([0]), torch.tensor([0]), torch.zeros(1, 2, 8), torch.full((1, 2, 8), float("nan")))
    cache.write(1, torch.tensor([0]), torch.tensor([1]), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    assert cache.scales.tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_cleared_pages_read_back_as_exact_zeros_and_poison_as_nan_with_any_scales():
    cache = _cache(scales=KVScales((2.0**-7, 3.7), (0.013, 2.0**20), "flag"), poison=True)
    cache.clear_pages(np.array([1, 2, 5], dtype=np.int32))
    for layer in range(2):
        for page in (1, 2, 5):
            keys, values = _read_back(cache, layer, page)
            assert torch.equal(keys, torch.zeros_like(keys)) and torch.equal(values, torch.zeros_like(values))
        keys, values = _read_back(cache, layer, 3)
        assert torch.isnan(keys).all() and torch.isnan(values).all()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(write_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden_size=96)), rank=0, world_size=1, dtype=torch.float32, device=CPU)


def _poison_run(model, *, poison: bool, clear: bool):
    driver = Driver(model, page_size=8, kv_dtype="fp8-e4m3", poison=poison, clear=clear, kv_scales=ScaleCalibration(model.config.num_layers))
    logits, generated = driver.greedy({0: PROMPT[:5], 1: PROMPT[:11]}, 4)
    return torch.cat(logits), generated, driver.cache.scales


def test_calibrated_fp8_poison_with_clears_is_clean_and_without_them_is_detected(tiny):
    clean, clean_tokens, clean_scales = _poison_run(tiny, poison=False, clear=True)
    poisoned, poisoned_tokens, poisoned_scales = _poison_run(tiny, poison=True, clear=True)
    assert torch.isfinite(clean).all() and not torch.equal(clean_scales, torch.ones_like(clean_scales))
    assert torch.equal(poisoned_scales, clean_scales)
    assert torch.equal(poisoned, clean) and poisoned_tokens == clean_tokens
    skipped, _, _ = _poison_run(tiny, poison=True, clear=False)
    assert not torch.isfinite(skipped[:2]).any(dim=-1).any(), "every row reads a stale slot"


# -- tensor parallelism: every rank calibrates to the same scales ------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _calibrate_shard(rank: int, world_size: int, port: int, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        # Each rank's own KV head: rank 1 holds layer 0's larger K and V, rank 0 layer 1's.
        largest = {0: (4.0, 0.1, 10.0, 9.0), 1: (40.0, 9.0, 1.0, 0.2)}[rank]
        cache = _cache(num_kv_heads=1, scales=ScaleCalibration(2, world_size))
        cache.begin_calibration()
        for layer in range(2):
            k = torch.linspace(-1.0, 1.0, 24).view(3, 1, 8) * largest[2 * layer]
            v = torch.linspace(-1.0, 1.0, 24).view(3, 1, 8) * largest[2 * layer + 1]
            cache.write(layer, torch.tensor([layer] * 3), torch.tensor([0, 1, 2]), k, v)
        torch.save(cache.scales, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def test_every_rank_calibrates_to_the_maximum_over_all_ranks(tmp_path):
    torch.multiprocessing.start_processes(
        _calibrate_shard, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    scales = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert torch.equal(scales[0], scales[1])
    # Layer 0: K max 40 and V max 9 (rank 1); layer 1: K max 10 and V max 9 (rank 0).
    expected = [[2.0 ** np.ceil(np.log2(40 / K_RANGE)), 2.0 ** np.ceil(np.log2(9 / V_RANGE))],
                [2.0 ** np.ceil(np.log2(10 / K_RANGE)), 2.0 ** np.ceil(np.log2(9 / V_RANGE))]]
    assert scales[0].tolist() == expected


# -- quality on the embedded model ----------------------------------------------------------------------

PERPLEXITY_DELTA_PCT = 2.0
KL_NATS = 0.03
NOISE_FACTOR = 1.3


@pytest.mark.timeout(600)
def test_smollm2_perplexity_with_calibrated_fp8_stays_within_the_bound_and_no_worse_than_scale_one():
    try:
        default_model_path()
    except ModelLoadError as missing:
        pytest.skip(str(missing))
    from scripts.bench_perplexity import CacheSetting, run

    # fp32 weights and reference cache: the fp8 cache's loss is the same question, and on a CPU without
    # native bf16 (AVX2 only) the three passes take a sixth of the time they take in bf16.
    settings = (
        CacheSetting("fp32", "fp32", "none"),
        CacheSetting("fp8_scale_1", "fp8-e4m3", "unit"),
        CacheSetting("fp8_calibrated", "fp8-e4m3", "calibrate"),
    )
    report = run("fp32", 64, settings=settings)
    assert report["tokens"] > 300
    calibrated, unit = report["against_reference"]["fp8_calibrated"], report["against_reference"]["fp8_scale_1"]
    assert abs(calibrated["perplexity_delta_pct"]) <= PERPLEXITY_DELTA_PCT
    assert 0 < calibrated["kl_nats"] <= KL_NATS and calibrated["top1_agreement"] >= 0.9
    assert calibrated["kl_nats"] <= NOISE_FACTOR * unit["kl_nats"]
    errors = report["kv_relative_error"]
    for part in ("k", "v"):
        assert errors["fp8_calibrated"][part]["max"] <= errors["fp8_scale_1"][part]["max"]
        assert errors["fp8_calibrated"][part]["mean"] <= errors["fp8_scale_1"][part]["mean"]
    assert errors["fp8_calibrated"]["v"]["max"] < errors["fp8_scale_1"]["v"]["max"]  # layer 0's small V


# -- compiled decode layers (slow: builds an fp8 library) ------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_compiled_decode_reads_the_calibrated_scales_as_eager_does(tmp_path):
    from tests.model.tp_worker import PROMPTS
    from tests.tiny_models import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", num_heads=16, num_kv_heads=2)
    runs = {}
    for mode in ("wait", "off"):
        model = load_model(
            str(path), rank=0, world_size=1, dtype=torch.bfloat16, device=CPU, weight_format="int4", compile_mode=mode
        )
        driver = Driver(model, num_kv_pages=32, page_size=4, kv_dtype="fp8-e4m3", kv_scales=ScaleCalibration(model.config.num_layers))
        logits, tokens = driver.greedy(PROMPTS, 6)
        runs[mode] = (torch.cat(logits), tokens, driver.cache.scales.clone())
        if mode == "wait":
            assert driver.runner.last_runner == "compiled", "decode steps ran compiled"
    assert not torch.equal(runs["wait"][2], torch.ones_like(runs["wait"][2]))
    assert torch.equal(runs["wait"][2], runs["off"][2])
    # The library sums in other orders (tests/model/test_runners.py allows 0.05 with a bf16 cache);
    # a K or V that lands on the other side of an fp8 rounding boundary then moves by a whole fp8
    # step (up to 1/8): measured 0.062 in 3 of 4480 logits.
    torch.testing.assert_close(runs["wait"][0], runs["off"][0], atol=0.15, rtol=0)
    assert runs["wait"][1] == runs["off"][1]
