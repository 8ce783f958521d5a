from dataclasses import replace

import pytest

from executor.options import ExecutorOptions, OptionsError
from executor.worker import ExecutorStartError, build_geometry, pick_device
from tests.executor.executor_standin import StandInConfig

BASE = ExecutorOptions(model="m", num_kv_pages=64, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"num_kv_pages": 0}, "num_kv_pages must be at least 1"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype must be one of"),
        ({"dtype": "fp8"}, "dtype must be one of"),
        ({"weight_format": "int3"}, "weight_format must be one of"),
        ({"device": "tpu"}, "device must be"),
        ({"num_host_pages": -1}, "num_host_pages"),
        ({"heartbeat_interval_s": 2.0, "peer_timeout_s": 1.0}, "must exceed heartbeat_interval_s"),
    ],
)
def test_bad_options_are_refused_with_the_field_named(change, words):
    with pytest.raises(OptionsError, match=words):
        replace(BASE, **change)


def test_geometry_comes_from_the_model_and_the_options():
    g = build_geometry(replace(BASE, kv_cache_dtype="fp8-e4m3", num_host_pages=4), StandInConfig())
    config = StandInConfig()
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.vocab_size) == (
        config.num_layers, config.num_kv_heads, config.head_dim, config.vocab_size,
    )
    assert (g.num_kv_pages, g.max_model_len, g.kv_dtype, g.num_host_pages) == (64, 128, "fp8-e4m3", 4)


def test_a_context_longer_than_the_model_is_refused():
    with pytest.raises(ExecutorStartError, match="max_model_len 1024 exceeds the model's context of 256"):
        build_geometry(replace(BASE, max_model_len=1024), StandInConfig())


def test_cpu_is_used_when_asked_or_when_there_is_no_cuda():
    assert pick_device(replace(BASE, device="cpu")).type == "cpu"
    assert pick_device(BASE).type == ("cuda" if __import__("torch").cuda.is_available() else "cpu")
