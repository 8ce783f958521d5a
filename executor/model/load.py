"""Loading a model: this rank's slices of a checkpoint, in the weight format asked for, as the
matrices of executor/model/layers.py by tensor-parallel role; `load_model` returns a LlamaModel."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from executor.gguf_file import Q4Blocks
from executor.kernels import INT4_MAX_ROWS, int4_packable
from executor.model.compiled import compile_mode as compile_mode_from_env
from executor.model.config import ModelConfig, ModelLoadError
from executor.model.gguf_source import GGUFSource
from executor.model.hf_source import HFSource
from executor.model.layers import (
    Linear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    SplitRowParallelLinear,
)
from executor.model.llama import LayerWeights, LlamaModel
from executor.model.sharding import RowParallelCuts, ShardPlan
from executor.model.source import WeightSource, files_digest
from executor.options import WEIGHT_FORMATS
from executor.probe import probe_cpu
from executor.weight_cache import ShardCache, open_cache, shard_key

log = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class WeightFormatError(ModelLoadError):
    """A weight format that this device, dtype or model file cannot run."""


def resolve_weight_format(
    weight_format: str, dtype: torch.dtype, device: torch.device, source: WeightSource
) -> str:
    """`auto` is what the start-up probe measured to be faster on this CPU (executor/probe.py):
    `mixed` or `dense`, where int4 can run (the CPU, bf16 or fp16 activations) and the file has
    4-bit matrices, else `dense`; an explicit int4 format that cannot run is refused."""
    if weight_format not in WEIGHT_FORMATS:
        raise WeightFormatError(f"weight format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    int4_runs = device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
    if weight_format == "auto":
        return probe_cpu().weight_format if int4_runs and source.stores_q4() else "dense"
    if weight_format == "dense":
        return weight_format
    if device.type != "cpu":
        raise WeightFormatError(f"weight format {weight_format} runs only on the CPU: torch's int4 kernel is CPU-only")
    if not int4_runs:
        raise WeightFormatError(
            f"weight format {weight_format} runs only with bf16 or fp16 activations: torch's CPU int4 "
            "kernel is about 10x slower than dense weights with fp32 ones"
        )
    if not source.stores_q4():
        raise WeightFormatError(
            f"{source.files[0]}: weight format {weight_format} needs 4-bit GGUF matrices (Q4_0 or "
            "Q4_1), and this model has none; use --weight-format dense"
        )
    return weight_format


def load_model(
    path: str,
    *,
    rank: int,
    world_size: int,
    dtype: torch.dtype,
    device: torch.device,
    weight_format: str = "dense",
    progress: bool = False,
    compile_mode: str | None = None,
    deterministic: bool = False,
) -> LlamaModel:
    """weight_format: `dense` (every matrix in `dtype`), `int4` (the file's 4-bit GGUF matrices
    stay 4-bit), `mixed` (both copies: int4 for steps of few rows, dense for the rest) or `auto`.
    compile_mode: compiled decode layers (executor.model.compiled), `$TP_RUNTIME_COMPILE` if None.
    deterministic: every row's output independent of its batch, chunking and the TP size
    (docs/invariance.md): one kernel per matrix at every row count (`mixed` loads as `int4`), the
    row-parallel matrices cut where two ranks cut them, the eager runner and its attention."""
    source = open_source(path)
    config = source.config
    shard = ShardPlan.build(config, rank, world_size)
    device = torch.device(device)
    requested, weight_format = weight_format, resolve_weight_format(weight_format, dtype, device, source)
    if deterministic and weight_format == "mixed":
        # One kernel per matrix whatever a step's rows: the 4-bit matrices' int4 copies only.
        weight_format = "int4"
    # Where a step switches from the int4 copies to the dense ones: measured on this CPU.
    int4_max_rows = probe_cpu().int4_max_rows if weight_format == "mixed" else INT4_MAX_ROWS
    cache = open_cache(  # the loaded shard on disk (executor/weight_cache.py): GGUF files on the CPU
        isinstance(source, GGUFSource) and device.type == "cpu",
        lambda: shard_key(Path(path), files_digest(source.files), dtype, weight_format, world_size, rank, deterministic),
    )
    cuts = RowParallelCuts.of(config) if deterministic and world_size == 1 else None
    reader = _ShardReader(source, shard, device, dtype, weight_format, int4_max_rows, cache, deterministic, cuts)
    show_bar = progress and sys.stderr.isatty()
    layers = [
        reader.layer(index) for index in Phase(f"loading {Path(path).name} (rank {rank})", config.num_layers, show_bar)
    ]
    _check_shapes(source, config, layers[0], shard)
    _check_int4_fits(path, requested, layers)
    embed = reader.weight("embed", rows=shard.vocab)
    tied = config.tie_embeddings or not source.has("lm_head")
    lm_head = embed if tied else reader.weight("lm_head", rows=shard.vocab)
    final_norm = reader.norm("final_norm")
    cache.commit()
    return LlamaModel(
        config,
        shard,
        embed=embed,
        lm_head=lm_head,
        final_norm=final_norm,
        layers=layers,
        fingerprint=fingerprint(source, config, world_size),
        device=device,
        compile_mode=compile_mode or compile_mode_from_env(),
        deterministic=deterministic,
    )


@dataclass(frozen=True)
class _ShardReader:
    """This rank's slices of a checkpoint, on the device, in the weight format asked for."""

    source: WeightSource
    shard: ShardPlan
    device: torch.device
    dtype: torch.dtype
    weight_format: str
    int4_max_rows: int
    cache: ShardCache
    deterministic: bool = False
    # The deterministic mode at TP=1: o_proj and down held as the slices two ranks hold.
    cuts: RowParallelCuts | None = None

    def weight(self, key: str, layer: int | None = None, rows=None, cols=None) -> torch.Tensor:
        return self.cache.tensor(f"weight/{key}/{layer}/{rows}/{cols}", lambda: self._read(key, layer, rows, cols))

    def _read(self, key: str, layer: int | None = None, rows=None, cols=None) -> torch.Tensor:
        return self.source.read(key, layer, rows, cols).to(device=self.device, dtype=self.dtype)

    def norm(self, key: str, layer: int | None = None) -> torch.Tensor:
        read = lambda: self.source.read(key, layer).to(device=self.device, dtype=torch.float32)  # noqa: E731
        return self.cache.tensor(f"norm/{key}/{layer}", read)

    def matrix(self, role: type[Linear], layer: int, *parts: tuple[str, dict[str, tuple[int, int]]], **extra) -> Linear:  # noqa: ANN003
        """One matrix of its tensor-parallel role from row-stacked slices, in the weight format asked for."""
        name = f"{layer}/{parts}"  # the matrix's name in the weight cache
        q4 = None
        if self.weight_format != "dense":
            q4 = self.cache.q4(f"q4/{name}", lambda: self._q4(layer, parts))
        dense = None
        if q4 is None or self.weight_format == "mixed":
            dense = self.cache.tensor(f"dense/{name}", lambda: torch.cat([self._read(key, layer, **span) for key, span in parts]))
        return role(dense, q4, dtype=self.dtype, int4_max_rows=self.int4_max_rows, deterministic=self.deterministic, **extra)

    def _q4(self, layer: int, parts: tuple[tuple[str, dict[str, tuple[int, int]]], ...]) -> Q4Blocks | None:
        blocks = [self.source.read_q4(key, layer, **span) for key, span in parts]
        if any(b is None for b in blocks):
            return None
        q4 = Q4Blocks.cat(blocks)
        return q4 if int4_packable(q4) else None

    def layer(self, index: int) -> LayerWeights:
        head_dim, shard = self.source.config.head_dim, self.shard
        q_rows = (shard.q_heads[0] * head_dim, shard.q_heads[1] * head_dim)
        kv_rows = (shard.kv_heads[0] * head_dim, shard.kv_heads[1] * head_dim)
        return LayerWeights(
            attn_norm=self.norm("attn_norm", index),
            qkv=self.matrix(
                QKVParallelLinear, index, ("q", {"rows": q_rows}), ("k", {"rows": kv_rows}), ("v", {"rows": kv_rows}),
                bias=self._qkv_bias(index, q_rows, kv_rows),
            ),
            o=self.row_parallel(index, "o", q_rows, self.cuts.o if self.cuts else None),
            ffn_norm=self.norm("ffn_norm", index),
            gate_up=self.matrix(
                MergedColumnParallelLinear, index, ("gate", {"rows": shard.ffn}), ("up", {"rows": shard.ffn})
            ),
            down=self.row_parallel(index, "down", shard.ffn, self.cuts.down if self.cuts else None),
        )

    def row_parallel(
        self, layer: int, key: str, cols: tuple[int, int], cuts: tuple[int, ...] | None
    ) -> RowParallelLinear | SplitRowParallelLinear:
        """o_proj or down: this rank's input columns, or (cuts) the slices two ranks would hold."""
        if cuts is None:
            world = self.shard.world_size
            return self.matrix(RowParallelLinear, layer, (key, {"cols": cols}), world_size=world, ordered=self.deterministic)
        parts = [self.matrix(Linear, layer, (key, {"cols": span})) for span in zip(cuts, cuts[1:])]
        return SplitRowParallelLinear(parts, cuts)

    def _qkv_bias(self, layer: int, q_rows: tuple[int, int], kv_rows: tuple[int, int]) -> torch.Tensor | None:
        """Column-parallel like QKV: each rank adds the biases of its own rows."""
        if not self.source.config.qkv_bias:
            return None
        spans = (("q_bias", q_rows), ("k_bias", kv_rows), ("v_bias", kv_rows))
        return torch.cat([self.weight(key, layer, rows) for key, rows in spans])


def _check_int4_fits(path: str, requested: str, layers: list[LayerWeights]) -> None:
    """An explicit int4 format is refused where none of the model's 4-bit matrices fits the kernel:
    it would run dense, against what was asked for."""
    if requested in ("int4", "mixed") and not any(
        m.int4 is not None for layer in layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ):
        raise WeightFormatError(
            f"{path}: weight format {requested}: none of its 4-bit matrices fits torch's int4 kernel "
            "(output rows in multiples of 16 on each rank); use --weight-format dense"
        )


def _check_shapes(source: WeightSource, config: ModelConfig, layer: LayerWeights, shard: ShardPlan) -> None:
    """The weights must have the shapes the config promises, or the forward would fail obscurely."""
    head_dim, hidden = config.head_dim, config.hidden_size
    expected_qkv = ((shard.local_q_heads + 2 * shard.local_kv_heads) * head_dim, hidden)
    if tuple(layer.qkv.shape) != expected_qkv or layer.attn_norm.shape[0] != hidden:
        raise ModelLoadError(
            f"{source.files[0]}: attention weights have shape {tuple(layer.qkv.shape)} for this "
            f"rank, but the config (hidden {hidden}, {config.num_heads} heads of {head_dim}, "
            f"{config.num_kv_heads} KV heads) implies {expected_qkv}"
        )
    expected_gate_up = (2 * (shard.ffn[1] - shard.ffn[0]), hidden)
    if tuple(layer.gate_up.shape) != expected_gate_up:
        raise ModelLoadError(
            f"{source.files[0]}: FFN weights have shape {tuple(layer.gate_up.shape)} for this rank, "
            f"but the config (intermediate size {config.intermediate_size}) implies {expected_gate_up}"
        )


def fingerprint(source: WeightSource, config: ModelConfig, world_size: int) -> str:
    digest = hashlib.sha256()
    digest.update(repr(sorted(asdict(config).items())).encode())
    digest.update(f"world_size={world_size}".encode())
    digest.update(files_digest(source.files).encode())
    return digest.hexdigest()[:32]



def open_source(path: str | os.PathLike[str]) -> WeightSource:
    location = Path(path)
    if not location.exists():
        raise ModelLoadError(f"{location}: no such model file or directory")
    if location.is_dir():
        return HFSource(location)
    stat = location.stat()
    return _open_gguf(location, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf(location: Path, _size: int, _mtime_ns: int) -> GGUFSource:
    """A GGUF file's header is parsed once per process while the file is unchanged (the launch
    checks, the ranks' resolve and their load all open it; a rank forked by the launcher inherits it)."""
    with location.open("rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{location}: not a GGUF file (magic {magic!r}) nor a model directory")
    return GGUFSource(location)


@dataclass
class Phase:
    """Progress of one loading phase: a tqdm bar on a terminal, else one log line at the end."""

    name: str
    total: int
    show_bar: bool

    def __iter__(self) -> Iterator[int]:
        if self.show_bar:
            from tqdm import tqdm

            yield from tqdm(range(self.total), desc=self.name, unit="layer")
        else:
            yield from range(self.total)
            log.info("%s: %d done", self.name, self.total)
