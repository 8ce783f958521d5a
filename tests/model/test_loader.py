"""Model files: clear errors for bad inputs, fingerprints, and each rank reading only its slices."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from executor.model import ModelLoadError, load_model
from executor.model.load import open_source
from tests.tiny_models import write_tiny_llama

CPU = torch.device("cpu")


def _load(path, rank=0, world_size=1):
    return load_model(str(path), rank=rank, world_size=world_size, dtype=torch.float32, device=CPU)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden_size=96)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such model file"):
        _load(tmp_path / "absent.gguf")


def test_file_that_is_not_gguf(tmp_path):
    bogus = tmp_path / "weights.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelLoadError, match=r"weights\.gguf: not a GGUF file"):
        _load(bogus)


def test_truncated_gguf(tmp_path):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x10" * 20)
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: not a readable GGUF file"):
        _load(truncated)


def test_config_missing_a_key(tmp_path, tiny_dir):
    directory = shutil.copytree(tiny_dir, tmp_path / "model")
    config = json.loads((directory / "config.json").read_text())
    del config["num_attention_heads"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config\.json.*num_attention_heads"):
        _load(directory)


def test_weights_that_do_not_match_the_config(tmp_path, tiny_dir):
    directory = shutil.copytree(tiny_dir, tmp_path / "model")
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] = 256  # the weights have 128
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"mlp\.gate_proj\.weight: slice \(0, 256\) is outside"):
        _load(directory)


def test_directory_without_weights(tmp_path, tiny_dir):
    directory = tmp_path / "model"
    directory.mkdir()
    shutil.copy(tiny_dir / "config.json", directory)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        _load(directory)


def test_fingerprint_identifies_the_weights(tmp_path, tiny_dir):
    same = _load(shutil.copytree(tiny_dir, tmp_path / "copy"))
    other = _load(write_tiny_llama(tmp_path / "other", hidden_size=96, seed=1))
    original = _load(tiny_dir)
    assert same.fingerprint == original.fingerprint
    assert other.fingerprint != original.fingerprint


def test_each_rank_holds_only_its_slices(tiny_dir):
    source = open_source(tiny_dir)
    rank1 = _load(tiny_dir, rank=1, world_size=2)  # 6 heads / 3 KV groups of 16 dims -> rank 1: 1 group
    layer = rank1.layers[0]
    assert rank1.shard.q_heads == (4, 6) and rank1.shard.kv_heads == (2, 3)
    assert layer.qkv.shape == ((2 + 2 * 1) * 16, 96)
    torch.testing.assert_close(layer.qkv.dense()[:32], source.read("q", 0)[64:96])
    torch.testing.assert_close(layer.o.dense(), source.read("o", 0)[:, 64:96])
    torch.testing.assert_close(layer.down.dense(), source.read("down", 0)[:, 64:128])
    assert rank1.embed.weight.shape == (256, 96)
