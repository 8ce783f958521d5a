"""The weight cache (executor/weight_cache.py): a second load maps the shard the first one wrote and
gives the same model; a change of model file, dtype, weight format, TP size or the code that fills
it finds no entry; a damaged or partial entry is refused, rebuilt, and never read."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

import executor.weight_cache as weight_cache
from executor.model import load_model
from executor.model.gguf_source import GGUFSource
from executor.model.load import _open_gguf
from tests.model.hermetic_cache import fix_probe
from tests.tiny_models import write_tiny_gguf

CPU = torch.device("cpu")


@pytest.fixture
def entries(tmp_path, monkeypatch) -> Path:
    """A cache root of this test's own; the directory the entries go to."""
    monkeypatch.setenv("TP_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    fix_probe()
    return tmp_path / "cache" / "weights"


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """Every tensor the loader reads from the GGUF file (none when a load is served by the cache)."""
    seen: list[str] = []
    read, read_q4 = GGUFSource.read, GGUFSource.read_q4
    monkeypatch.setattr(GGUFSource, "read", lambda self, key, *a, **k: (seen.append(key), read(self, key, *a, **k))[1])
    monkeypatch.setattr(GGUFSource, "read_q4", lambda self, key, *a, **k: (seen.append(key), read_q4(self, key, *a, **k))[1])
    return seen


@pytest.fixture
def model_file(tmp_path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def _load(path: Path, *, dtype=torch.float32, weight_format="dense", rank=0, world_size=1):  # noqa: ANN001, ANN202
    return load_model(str(path), rank=rank, world_size=world_size, dtype=dtype, device=CPU, weight_format=weight_format)


def _weights(model) -> list[torch.Tensor]:  # noqa: ANN001
    out = [model.embed.weight, model.final_norm]
    for layer in model.layers:
        out += [layer.attn_norm, layer.ffn_norm]
        for matrix in (layer.qkv, layer.o, layer.gate_up, layer.down):
            out.append(matrix.dense())
            if matrix.int4 is not None:
                out += [matrix.int4, matrix.int4_scales]
    return out


def _same(a, b) -> bool:  # noqa: ANN001
    return all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(b), strict=True))


def test_a_second_load_maps_the_shard_and_gives_the_same_model(model_file, entries, reads) -> None:
    first = _load(model_file)
    assert reads and len(list(entries.glob("*.safetensors"))) == 1
    reads.clear()
    second = _load(model_file)
    assert reads == []  # nothing dequantized: every tensor came from the entry
    assert _same(first, second)
    assert second.fingerprint == first.fingerprint


def test_mixed_weights_keep_their_4bit_blocks_too(model_file, entries, reads) -> None:
    first = _load(model_file, dtype=torch.bfloat16, weight_format="mixed")
    assert any(layer.qkv.int4 is not None for layer in first.layers)
    reads.clear()
    second = _load(model_file, dtype=torch.bfloat16, weight_format="mixed")
    assert reads == [] and _same(first, second)


@pytest.mark.parametrize(
    "change",
    ["model file", "dtype", "weight format", "tp size", "code"],
)
def test_what_an_entry_depends_on_invalidates_it(change, model_file, entries, reads, monkeypatch, tmp_path) -> None:
    _load(model_file, dtype=torch.bfloat16)
    reads.clear()
    kwargs = {"dtype": torch.bfloat16}
    if change == "model file":
        write_tiny_gguf(model_file, seed=1)  # other weights, same path
        _open_gguf.cache_clear()
    elif change == "dtype":
        kwargs["dtype"] = torch.float32
    elif change == "weight format":
        kwargs["weight_format"] = "mixed"
    elif change == "tp size":
        kwargs.update(world_size=2)
    else:
        monkeypatch.setattr(weight_cache, "_code_digest", lambda: "edited")
    changed = _load(model_file, **kwargs)
    assert reads, f"a changed {change} must not be served by the old entry"
    reads.clear()
    assert _same(changed, _load(model_file, **kwargs)) and reads == []  # and the new entry serves it next


def test_a_new_entry_replaces_the_stale_one_of_its_slot(model_file, entries, monkeypatch) -> None:
    _load(model_file)
    monkeypatch.setattr(weight_cache, "_code_digest", lambda: "edited")
    _load(model_file)
    assert len(list(entries.glob("*.safetensors"))) == 1


def _damage_data(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-7] ^= 0xFF  # inside the last tensor's bytes
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:24] = b"\x00" * 16
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_damage_data, _truncate, _garble_header], ids=["flipped byte", "partial", "header"])
def test_a_damaged_entry_is_refused_and_rebuilt(damage, model_file, entries, reads, caplog) -> None:
    fresh = _load(model_file)
    (entry,) = entries.glob("*.safetensors")
    damage(entry)
    reads.clear()
    with caplog.at_level(logging.WARNING, logger="executor.weight_cache"):
        rebuilt = _load(model_file)
    assert "refused" in caplog.text
    assert reads, "the damaged entry must not serve the load"
    assert _same(fresh, rebuilt)
    reads.clear()
    _load(model_file)
    assert reads == []  # the rebuilt entry is whole again


def test_an_entry_of_another_key_under_its_name_is_refused(model_file, entries, reads, caplog) -> None:
    _load(model_file, dtype=torch.bfloat16)
    _load(model_file, dtype=torch.float32)
    bf16, fp32 = sorted(entries.glob("*.safetensors"), key=os.path.getmtime)
    os.replace(bf16, fp32)  # the fp32 name now holds the bf16 shard
    reads.clear()
    with caplog.at_level(logging.WARNING, logger="executor.weight_cache"):
        model = _load(model_file, dtype=torch.float32)
    assert "refused" in caplog.text and reads
    assert model.layers[0].qkv.dtype == torch.float32


def test_turned_off_it_writes_nothing(model_file, entries, monkeypatch) -> None:
    monkeypatch.setenv(weight_cache.ENV, "off")
    _load(model_file)
    assert not entries.exists()
