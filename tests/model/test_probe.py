"""The start-up probe (executor/probe.py): its rule from timings to a choice, its cache per machine
(measured on the first start, read on the second), and `auto` following it in the launcher and the
loader."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import torch

from executor import probe
from executor.model import resolve_weight_format
from executor.model.load import open_source
from tests.model.hermetic_cache import FIXED_PROBE
from tests.tiny_models import write_tiny_gguf
from tp_runtime.config import RuntimeConfig
from tp_runtime.resolve import pick_dtype


def timings(fp32: float, bf16: float, int4: dict[int, float], prefill: tuple[float, float] = (10.0, 5.0)) -> dict[str, float]:
    """fp32 and bf16 at one row, int4 by row count against a dense bf16 that costs `bf16` at every
    count, and (fp32, bf16) at the prefill row count."""
    ms = {"fp32_1": fp32, f"fp32_{probe.PREFILL_ROWS}": prefill[0], f"bf16_{probe.PREFILL_ROWS}": prefill[1]}
    for rows in probe.INT4_ROWS:
        ms[f"bf16_{rows}"] = bf16
        ms[f"int4_{rows}"] = int4.get(rows, 2 * bf16)
    return ms


def test_bf16_where_it_is_faster_and_int4_up_to_the_crossover():
    result = probe.decide(timings(4.0, 2.0, {1: 0.8, 2: 0.9, 4: 1.2, 8: 1.9, 12: 2.5}), threads=2)
    assert (result.dtype, result.weight_format, result.int4_max_rows) == ("bf16", "mixed", 8)
    assert "0.50x fp32's time at 1 row" in result.reason and "up to 8 rows (1.25x at 12)" in result.reason


def test_fp32_where_bf16_is_slower_and_then_no_int4():
    # The AVX2-only EPYC of earlier sessions: bf16 2-5x slower than fp32.
    result = probe.decide(timings(4.0, 12.0, {1: 1.0}, prefill=(10.0, 50.0)), threads=2)
    assert (result.dtype, result.weight_format) == ("fp32", "dense")
    assert "int4 kernel takes bf16 activations" in result.reason


def test_dense_where_int4_loses_at_one_row():
    result = probe.decide(timings(4.0, 2.0, {1: 2.5}), threads=2)
    assert (result.dtype, result.weight_format) == ("bf16", "dense")


def test_one_disagreement_is_settled_by_the_geometric_mean():
    faster_decode = probe.decide(timings(4.0, 1.0, {}, prefill=(10.0, 20.0)), threads=2)  # 0.25 x 2.0
    slower_decode = probe.decide(timings(4.0, 3.6, {}, prefill=(10.0, 12.0)), threads=2)  # 0.9 x 1.2
    assert (faster_decode.dtype, slower_decode.dtype) == ("bf16", "fp32")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TP_RUNTIME_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_the_first_start_measures_and_the_second_reads_what_it_kept(empty_cache, monkeypatch):
    measured = []
    result = replace(FIXED_PROBE, reason="measured by the test")
    monkeypatch.setattr(probe, "measure", lambda: measured.append(1) or result)
    assert probe.probe_cpu() == result and measured == [1]
    assert json.loads(probe.probe_path().read_text()) == asdict(result)
    assert probe.probe_cpu() == result and measured == [1], "the second start measured again"
    # Another thread count is another measurement; an unreadable entry is measured again.
    assert probe.probe_path(threads=torch.get_num_threads() + 1) != probe.probe_path()
    probe.probe_path().write_text("{not json")
    assert probe.probe_cpu() == result and measured == [1, 1]


def test_the_key_is_the_cpu_and_torch(empty_cache, monkeypatch):
    path = probe.probe_path()
    identity = dict(probe.cpu_identity())
    monkeypatch.setattr(probe, "cpu_identity", lambda: {**identity, "cpu_flags": "another CPU's"})
    assert probe.probe_path() != path
    monkeypatch.setattr(probe, "cpu_identity", lambda: {**identity, "torch": "2.99.0"})
    assert probe.probe_path() != path


def test_a_real_measurement_gives_a_choice_with_its_reason(empty_cache):
    result = probe.probe_cpu()
    assert result.dtype in ("fp32", "bf16") and result.weight_format in ("dense", "mixed")
    assert result.int4_max_rows in probe.INT4_ROWS and result.threads == torch.get_num_threads()
    assert result.dtype in result.reason and all(value > 0 for value in result.timings_ms.values())
    assert probe.probe_cpu() == result


def test_auto_follows_the_probe_in_the_launcher_and_the_loader(empty_cache, tmp_path, monkeypatch):
    source = open_source(write_tiny_gguf(tmp_path / "tiny.gguf"))
    for choice in (replace(FIXED_PROBE, dtype="fp32", weight_format="dense"), FIXED_PROBE):
        probe.probe_path().parent.mkdir(parents=True, exist_ok=True)
        probe.probe_path().write_text(json.dumps(asdict(choice)))
        assert pick_dtype(RuntimeConfig(model=str(tmp_path / "tiny.gguf"), device="cpu")) == choice.dtype
        assert resolve_weight_format("auto", torch.bfloat16, torch.device("cpu"), source) == choice.weight_format
    assert pick_dtype(RuntimeConfig(model="m", device="cpu", dtype="fp16")) == "fp16", "an explicit dtype stays"
