"""scripts/bench_startup.py in its short form, on a tiny GGUF model: one traced `generate` per TP size,
and a report that has every phase of the breakdown."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.bench_startup import PHASES, REQUIRED, bench, parse_args
from tests.tiny_models import write_tiny_gguf, write_tiny_llama


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A GGUF model (its load goes through the weight cache) and a tokenizer for it (the GGUF has none)."""
    root = tmp_path_factory.mktemp("startup")
    return write_tiny_gguf(root / "tiny.gguf"), write_tiny_llama(root / "tokenizer")


def test_the_breakdown_has_every_phase(tiny_gguf: tuple[Path, Path]) -> None:
    model, tokenizer = tiny_gguf
    args = parse_args([
        "--tp", "1,2", "--runs", "1", "--warmup", "0", "--max-tokens", "4", "--model", str(model), "--timeout", "240",
        "--", "--tokenizer", str(tokenizer), "--raw", "--dtype", "fp32", "--num-kv-pages", "64", "--max-model-len", "256",
    ])  # fmt: skip
    report = bench(args)
    assert set(report["tp"]) == {"1", "2"}
    for tp, entry in report["tp"].items():
        phases = entry["ours"]["phases_s"]
        assert set(phases) == {phase.name for phase in PHASES}
        missing = [name for name in REQUIRED if phases[name] is None]
        assert not missing, f"TP={tp}: no stamps for {missing}"
        assert all(phases[name] >= 0 for name in REQUIRED), phases
        assert phases["first_token"] <= phases["total"]
        if tp == "2":
            assert phases["process_group"] is not None
        assert set(entry["ours"]["cpu_s"]) >= {"launcher", "frontend", "rank0"}
        assert entry["text"], "the run printed no text"
        assert entry["ours"]["critical_path"][-1] == "submit_to_first_token"
