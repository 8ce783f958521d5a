"""What this CPU computes fastest, timed once per machine: `--dtype auto` and `--weight-format auto`.

The CPUs these sessions land on differ (an AVX-512 + AMX Xeon, an AVX2-only EPYC on which bf16 ran
2-5x slower than fp32, AVX-512 Zen 4 and Zen 5 EPYCs on which it ran faster), so rather than a
table of CPU flags the executor times the kernels a step would run, on matrices large enough to
stream from memory as a model's do:

- dense fp32 against dense bf16 (oneDNN-packed, as executor.kernels.Matrix holds them) at 1
  row (a decode step reads every weight once) and at 128 rows (a prefill chunk computes): bf16
  when it is faster at both, or by the geometric mean of the two ratios when they disagree;
- with bf16, torch's int4 kernel against dense bf16 at 1 to 32 rows: `mixed` when int4 is faster
  at 1 row, and int4 is used up to the largest row count before it first loses (the crossover),
  else `dense`.

Each matrix's time is the fastest of several calls, interleaved with the other kernels' and each
pass after a flush of the last-level cache, and the rounds go on until two in a row agree, so
that a busy neighbour slows the probe without deciding it. The
result, with its timings and reason, is kept in the executor's disk cache (executor/disk_cache.py)
under the CPU's identity, torch's version and the thread count; a second start reads it.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from executor.disk_cache import cache_root, cpu_identity, digest, file_lock, write_atomically
from executor.gguf_file import Q4_BLOCK, Q4Blocks
from executor.kernels import Matrix

log = logging.getLogger(__name__)

PROBE_VERSION = 1
INT4_ROWS = (1, 2, 4, 8, 12, 16, 24, 32)
PREFILL_ROWS = 128
MATRICES, OUT_FEATURES, IN_FEATURES = 8, 2048, 1024  # 32 MB of bf16 weights per pass
REPEATS = 3
MAX_ROUNDS = 5


@dataclass(frozen=True)
class ProbeResult:
    dtype: str  # fp32 or bf16: the dense compute dtype `--dtype auto` takes on this CPU
    weight_format: str  # dense or mixed: what `--weight-format auto` takes for a 4-bit file in bf16
    int4_max_rows: int  # mixed: steps of at most this many rows use the int4 copies
    reason: str
    timings_ms: dict[str, float]
    threads: int
    measured_at: str


def probe_path(threads: int | None = None) -> Path:
    """Where this machine's result lives for a process of `threads` threads (default: this one's)."""
    key = digest({**cpu_identity(), "threads": threads or torch.get_num_threads(), "version": PROBE_VERSION})
    return cache_root() / "probe" / f"{key}.json"


def probe_cpu() -> ProbeResult:
    """This machine's result: read from the cache, or measured now (about a second) and kept.

    Concurrent starts (the ranks of one launch) measure once: the others wait for the lock and
    read what the first wrote, so every rank resolves `auto` alike."""
    path = probe_path()
    cached = _read(path)
    if cached is not None:
        log.info(f"probe (cached in {path}): {cached.reason}")
        return cached
    with file_lock(path.with_suffix(".lock")):
        cached = _read(path)
        if cached is not None:
            return cached
        begin = time.monotonic()
        result = measure()
        write_atomically(path, json.dumps(asdict(result), indent=1).encode())
    log.warning(f"probed this CPU in {time.monotonic() - begin:.1f} s (kept in {path}): {result.reason}")
    return result


def _read(path: Path) -> ProbeResult | None:
    try:
        return ProbeResult(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def measure() -> ProbeResult:
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator) * 0.02 for _ in range(MATRICES)]
    kernels = {
        "fp32": [Matrix(w) for w in weights],
        "bf16": [Matrix(w.bfloat16()) for w in weights],
        "int4": [Matrix(None, _blocks(w), dtype=torch.bfloat16) for w in weights],
    }
    del weights
    flush = torch.empty(_flush_bytes() // 4)
    cases = [("fp32", rows) for rows in (1, PREFILL_ROWS)] + [("bf16", PREFILL_ROWS)]
    cases += [(kind, rows) for rows in INT4_ROWS for kind in ("bf16", "int4")]
    inputs = {
        (kind, rows): torch.randn(rows, IN_FEATURES, generator=generator).to(kernels[kind][0].dtype)
        for kind, rows in cases
    }
    # The fastest call of each matrix, summed: a call that a busy neighbour preempted (on 2 cores
    # an OpenMP region waits for its descheduled thread) is discarded. Rounds of REPEATS calls go
    # on until two in a row give the same choice (at most MAX_ROUNDS).
    best = {case: [float("inf")] * MATRICES for case in cases}
    previous = None
    with torch.inference_mode():
        for case in cases:  # warm-up: each shape's first call pays oneDNN's set-up
            kernels[case[0]][0](inputs[case])
        for _ in range(MAX_ROUNDS):
            for _ in range(REPEATS):
                for case in cases:
                    flush.fill_(1.0)
                    for index, linear in enumerate(kernels[case[0]]):
                        start = time.perf_counter()
                        linear(inputs[case])
                        best[case][index] = min(best[case][index], time.perf_counter() - start)
            ms = {f"{kind}_{rows}": sum(seconds) * 1e3 for (kind, rows), seconds in best.items()}
            result = decide(ms, torch.get_num_threads())
            choice = (result.dtype, result.weight_format, result.int4_max_rows)
            if choice == previous:
                break
            previous = choice
    return result


def decide(ms: dict[str, float], threads: int) -> ProbeResult:
    """The choice and its reason from the timings (in ms, keyed `<kernel>_<rows>`)."""
    decode_ratio = ms["bf16_1"] / ms["fp32_1"]
    prefill_ratio = ms[f"bf16_{PREFILL_ROWS}"] / ms[f"fp32_{PREFILL_ROWS}"]
    dtype = "bf16" if (decode_ratio * prefill_ratio) ** 0.5 < 1.0 else "fp32"
    reason = (
        f"--dtype auto is {dtype}: dense bf16 takes {decode_ratio:.2f}x fp32's time at 1 row and "
        f"{prefill_ratio:.2f}x at {PREFILL_ROWS} rows"
    )
    crossover = 0
    for rows in INT4_ROWS:
        if ms[f"int4_{rows}"] > ms[f"bf16_{rows}"]:
            break
        crossover = rows
    if dtype != "bf16":
        weight_format = "dense"
        reason += "; --weight-format auto is dense (torch's int4 kernel takes bf16 activations)"
    elif crossover == 0:
        weight_format = "dense"
        reason += f"; --weight-format auto is dense: int4 takes {ms['int4_1'] / ms['bf16_1']:.2f}x bf16's time at 1 row"
    else:
        weight_format = "mixed"
        reason += (
            f"; --weight-format auto is mixed: int4 takes {ms['int4_1'] / ms['bf16_1']:.2f}x bf16's time at 1 row "
            f"and is used up to {crossover} rows"
        )
        if crossover < INT4_ROWS[-1]:
            above = INT4_ROWS[INT4_ROWS.index(crossover) + 1]
            reason += f" ({ms[f'int4_{above}'] / ms[f'bf16_{above}']:.2f}x at {above})"
    return ProbeResult(
        dtype=dtype,
        weight_format=weight_format,
        int4_max_rows=crossover or INT4_ROWS[0],
        reason=reason,
        timings_ms={key: round(value, 4) for key, value in ms.items()},
        threads=threads,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def _blocks(weight: torch.Tensor) -> Q4Blocks:
    """4-bit blocks of a matrix (values do not matter to the kernel's speed, only the layout)."""
    w = weight.numpy().reshape(weight.shape[0], -1, Q4_BLOCK)
    low, high = w.min(axis=-1), w.max(axis=-1)
    scale = np.maximum((high - low) / 15.0, 1e-8)
    q = np.clip(np.rint((w - low[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    return Q4Blocks(q.reshape(weight.shape), scale.astype(np.float32), low.astype(np.float32))


def _flush_bytes() -> int:
    """Twice the last-level cache (64 MiB where sysfs does not say)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(64 << 20, 2 * max(sizes, default=0))


if __name__ == "__main__":
    # `python -m executor.probe [--again]`: this machine's result (measured anew with --again).
    logging.basicConfig(level=logging.INFO)
    if "--again" in sys.argv:
        probe_path().unlink(missing_ok=True)
    print(json.dumps(asdict(probe_cpu()), indent=1))
