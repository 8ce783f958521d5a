"""Perplexity of the embedded SmolLM2 over a fixed text, by KV-cache dtype and fp8 scales; prints JSON.

    python scripts/bench_perplexity.py [--dtype fp32] [--chunk 64] [--text tests/data/perplexity.txt]

The text (tests/data/perplexity.txt, 413 tokens) is three public-domain paragraphs: the opening of
Austen's Pride and Prejudice (1813), of chapter I of Darwin's On the Origin of Species (1859), and
most of Lincoln's Gettysburg Address (1863). It is prefilled in chunks of --chunk tokens, as a
serving prefill would be, every chunk attending to the earlier ones through the paged cache; each
chunk's logits at every position give the next token's log-likelihood. The model's weights and
activations are the same in every run (--dtype), so the differences are the KV cache's alone:
fp32 (the reference), bf16, fp8-e4m3 at scale 1.0 (vLLM without calibration), and fp8-e4m3 with
per-layer scales calibrated on the first chunk (executor/kv_scales.py; later chunks use them
frozen, as later tokens do in serving). The cache is poisoned at allocation and its pages cleared
before first use, as the runtime does.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from executor.cache import FP8_E4M3_MAX, KVCache  # noqa: E402
from executor.inputs import StepInputs  # noqa: E402
from executor.kv_scales import KVScales, ScaleCalibration  # noqa: E402
from executor.model import TORCH_DTYPES, LlamaModel, default_model_path, load_model  # noqa: E402
from protocol.frames import Prepare  # noqa: E402

TEXT = REPO / "tests" / "data" / "perplexity.txt"
PAGE_SIZE = 16


@dataclass(frozen=True)
class CacheSetting:
    name: str
    kv_dtype: str
    scales: str  # "none" (not fp8), "unit" or "calibrate"

    def cache_scales(self, num_layers: int) -> KVScales | ScaleCalibration | None:
        if self.scales == "unit":
            return KVScales.uniform(num_layers, 1.0)
        if self.scales == "calibrate":
            return ScaleCalibration(num_layers)
        return None


SETTINGS = (
    CacheSetting("fp32", "fp32", "none"),
    CacheSetting("bf16", "bf16", "none"),
    CacheSetting("fp8_scale_1", "fp8-e4m3", "unit"),
    CacheSetting("fp8_calibrated", "fp8-e4m3", "calibrate"),
)


@dataclass(frozen=True)
class Measurement:
    perplexity: float
    scales: list[list[float]]  # [layer][K, V]
    logprobs: torch.Tensor  # float32 [tokens - 1, vocab]: each position's next-token distribution
    kv: torch.Tensor  # float32 [pages, layers, 2, page_size, heads, head_dim]: the cache read back

    def against(self, reference: Measurement) -> dict[str, float]:
        """Perplexity change in percent; mean KL(reference || this) per token in nats, and how often
        the two agree on the most likely next token: perplexity alone can move either way by chance,
        the divergence only grows with the damage."""
        kl = (reference.logprobs.exp() * (reference.logprobs - self.logprobs)).sum(-1).mean()
        top1 = (reference.logprobs.argmax(-1) == self.logprobs.argmax(-1)).float().mean()
        return {
            "perplexity_delta_pct": 100 * (self.perplexity / reference.perplexity - 1),
            "kl_nats": float(kl),
            "top1_agreement": float(top1),
        }


def measure(model: LlamaModel, tokens: list[int], setting: CacheSetting, chunk: int = 64) -> Measurement:
    """Teacher-forced perplexity of tokens[1:] given their prefixes, over a fresh cache."""
    num_pages = -(-len(tokens) // PAGE_SIZE)
    config = model.config
    cache = KVCache(
        num_kv_pages=num_pages,
        page_size=PAGE_SIZE,
        num_layers=config.num_layers,
        num_kv_heads=model.shard.local_kv_heads,
        head_dim=config.head_dim,
        kv_dtype=setting.kv_dtype,
        device=model.device,
        poison=True,
        scales=setting.cache_scales(config.num_layers),
    )
    cache.clear_pages(np.arange(num_pages, dtype=np.int32))
    logprobs = []
    for start in range(0, len(tokens) - 1, chunk):
        stop = min(start + chunk, len(tokens) - 1)
        pages = -(-stop // PAGE_SIZE)
        prepare = Prepare.greedy([stop - start], [stop], tokens[start:stop], [pages], np.arange(pages))
        inputs = StepInputs.from_prepare(prepare, pad_page=cache.pad_page, page_size=PAGE_SIZE, device=model.device)
        # Every row's logits, not only the last one's that a serving step samples.
        inputs = replace(inputs, sample_rows=torch.arange(stop - start, device=model.device))
        if cache.calibration_pending:
            cache.begin_calibration()
        logprobs.append(torch.log_softmax(model.forward(inputs, cache).float(), dim=-1).cpu())
    every = torch.cat(logprobs)
    nll = -every.gather(1, torch.tensor(tokens[1:])[:, None]).mean()
    kv = cache.data[:num_pages].float() * cache.scales[None, :, :, None, None, None]
    return Measurement(math.exp(float(nll)), cache.scales.tolist(), every, kv.cpu())


def quantization_error(kv: torch.Tensor, scales: list[list[float]]) -> torch.Tensor:
    """[layers, 2]: relative RMS error of each layer's K and V (kv, as a reference run wrote them)
    stored in fp8-e4m3 with `scales` and read back: what the scales alone change, apart from how
    the errors then travel through the layers above."""
    s = torch.tensor(scales)[None, :, :, None, None, None]
    stored = (kv / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    dims = (0, 3, 4, 5)
    return ((stored - kv).square().sum(dims) / kv.square().sum(dims)).sqrt()


def run(dtype: str = "fp32", chunk: int = 64, text: Path = TEXT, settings=SETTINGS) -> dict:
    """Every setting over the text; the first one is the reference the others are compared with."""
    from tp_runtime.tokenizer import Tokenizer

    path = default_model_path()
    tokens = Tokenizer.from_model_path(path).encode(text.read_text())
    model = load_model(path, rank=0, world_size=1, dtype=TORCH_DTYPES[dtype], device=torch.device("cpu"), weight_format="dense")
    results, seconds = {}, {}
    for setting in settings:
        begin = time.perf_counter()
        results[setting.name] = measure(model, tokens, setting, chunk)
        seconds[setting.name] = round(time.perf_counter() - begin, 2)
    reference = results[settings[0].name]
    settings_by_name = {setting.name: setting for setting in settings}
    calibrated = results.get("fp8_calibrated")
    return {
        "model": Path(path).name,
        "dtype": dtype,
        "text": str(text.relative_to(REPO)) if text.is_relative_to(REPO) else str(text),
        "tokens": len(tokens),
        "chunk": chunk,
        "reference": settings[0].name,
        "perplexity": {name: round(m.perplexity, 4) for name, m in results.items()},
        "against_reference": {
            name: {key: round(value, 5) for key, value in m.against(reference).items()}
            for name, m in results.items()
            if m is not reference
        },
        # The reference's K and V stored with each fp8 setting's scales: mean and worst layer.
        "kv_relative_error": {
            name: {
                part: {"mean": round(float(e[:, i].mean()), 5), "max": round(float(e[:, i].max()), 5)}
                for i, part in enumerate(("k", "v"))
            }
            for name, m in results.items()
            if settings_by_name[name].kv_dtype == "fp8-e4m3"
            for e in [quantization_error(reference.kv, m.scales)]
        },
        "calibrated_scales": None
        if calibrated is None
        else {
            "k_min": min(s[0] for s in calibrated.scales),
            "k_max": max(s[0] for s in calibrated.scales),
            "v_min": min(s[1] for s in calibrated.scales),
            "v_max": max(s[1] for s in calibrated.scales),
        },
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weights and activations")
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk: tokens per step")
    parser.add_argument("--text", type=Path, default=TEXT)
    args = parser.parse_args(argv)
    if args.chunk < 1:
        parser.error("--chunk must be at least 1")
    print(json.dumps(run(args.dtype, args.chunk, args.text.resolve())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
