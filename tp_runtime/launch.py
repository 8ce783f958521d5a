"""Process launch: torchrun workers (one executor per rank) and rank 0's frontend child.

`tp-runtime serve|generate` outside torchrun re-enters itself through torch.distributed's own
launcher (`torch.distributed.run`), so that the canonical `torchrun --nproc-per-node N -m tp_runtime
serve` and the convenience command are the same code path.

Bootstrap secrets: the frontend process (the scheduler) makes the HMAC key and the run id and binds
its endpoint; it hands them to rank 0 over a private pipe, and rank 0 broadcasts them to the other
ranks as a uint8 tensor over the torch.distributed group. The key never travels on a frame socket.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta

from typing import TYPE_CHECKING

from tp_runtime.config import ConfigError, RuntimeConfig

if TYPE_CHECKING:
    from executor.model.config import ModelConfig

log = logging.getLogger("tp_runtime.launch")

FRONTEND_GRACE_S = 10.0  # rank 0 waits this long for its frontend to drain and exit


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def read_model_config(config: RuntimeConfig) -> ModelConfig:
    """The model's shape from its files' metadata, without reading weights; a weight format that
    this model, dtype and device cannot run is refused here, before any rank starts."""
    import torch

    from executor.model import TORCH_DTYPES, resolve_weight_format
    from executor.model.loader import open_source

    source = open_source(config.model)
    device = torch.device("cuda" if uses_cuda(config) else "cpu")
    # Each rank resolves `auto` again as it loads; it alone knows which of its slices int4 takes.
    resolve_weight_format(config.weight_format, TORCH_DTYPES[config.dtype], device, source)
    return source.config


def uses_cuda(config: RuntimeConfig) -> bool:
    import torch

    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


def pick_dtype(config: RuntimeConfig) -> str:
    """`auto`: bf16 on GPUs; on the CPU whichever of bf16 and fp32 the start-up probe timed faster
    on this machine (executor/probe.py: measured once, kept, the reason logged)."""
    if config.dtype != "auto":
        return config.dtype
    if uses_cuda(config):
        return "bf16"
    from executor.probe import probe_cpu

    return probe_cpu().dtype


def resolve(config: RuntimeConfig) -> RuntimeConfig:
    """Fills in what derives from the model and the machine: the dtype, the context length and the
    number of KV pages.

    Every rank computes the same answer from the same files, so plain torchrun (without the
    convenience launcher) agrees with itself too.
    """
    from executor.model.sharding import ShardingError, ShardPlan

    config = replace(config, dtype=pick_dtype(config))
    model = read_model_config(config)
    world = config.tensor_parallel_size
    try:
        plans = [ShardPlan.build(model, rank, world) for rank in range(world)]
    except ShardingError as exc:
        raise ConfigError(f"--tensor-parallel-size {world} cannot split {config.model}: {exc}") from None
    max_len = config.max_model_len or model.max_position_embeddings
    if max_len > model.max_position_embeddings:
        raise ConfigError(f"--max-model-len {max_len} exceeds the model's context of {model.max_position_embeddings} tokens")
    kv_bytes = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8-e4m3": 1}[config.resolved_kv_dtype]
    local_heads = max(p.local_kv_heads for p in plans)
    page_bytes = model.num_layers * 2 * config.page_size * local_heads * model.head_dim * kv_bytes
    pages = config.num_kv_pages or config.kv_cache_memory // page_bytes
    if pages * config.page_size < max_len:
        raise ConfigError(
            f"the KV cache holds {pages} pages of {config.page_size} tokens, fewer than one sequence of "
            f"--max-model-len {max_len} needs; raise --kv-cache-memory or --num-kv-pages, or lower --max-model-len"
        )
    if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
        raise ConfigError("--max-num-seqs and --max-num-batched-tokens must be at least 1")
    return replace(
        config, max_model_len=max_len, num_kv_pages=int(pages), num_host_pages=int(config.swap_space // page_bytes)
    )


def launch(config: RuntimeConfig, argv: list[str]) -> int:
    """Starts `python -m tp_runtime <argv>` on tensor_parallel_size ranks through torchrun's launcher."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # Each rank gets its share of the cores (torchrun would otherwise set 1 and print a banner).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)))
    torchrun_args = get_args_parser().parse_args(
        [
            "--standalone",
            f"--nproc-per-node={config.tensor_parallel_size}",
            "--max-restarts=0",
            "--monitor-interval=0.2",
            "-m",
            "tp_runtime",
            *argv,
        ]
    )
    try:
        run(torchrun_args)
    except SignalException as exc:
        # SIGTERM/SIGINT: torchrun passed it to the ranks, whose frontend drained before exiting.
        log.info("stopped by %s", exc.sigval.name)
        return 0
    except ChildFailedError:  # torchrun has printed which rank failed and why
        return 1
    return 0


def run_worker(config: RuntimeConfig, mode: str, job: list[str]) -> int:
    """Body of one torchrun worker: rank 0 also owns the frontend process."""
    import torch
    import torch.distributed as dist

    from executor.options import ExecutorOptions
    from executor.worker import run_executor

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world != config.tensor_parallel_size:
        raise ConfigError(f"torchrun started {world} ranks but --tensor-parallel-size is {config.tensor_parallel_size}")
    logging.basicConfig(
        level=config.log_level.upper(), format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"
    )
    config = resolve(config)
    use_cuda = uses_cuda(config)
    if world > 1:
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            timeout=timedelta(seconds=60),
            device_id=torch.device("cuda", local_rank) if use_cuda else None,
        )
    bootstrap = dist.new_group(backend="gloo") if world > 1 and use_cuda else None

    frontend: subprocess.Popen[bytes] | None = None
    secrets = b""
    if rank == 0:
        frontend, secrets = _start_frontend(config, mode, job)
    if world > 1:
        secrets = _broadcast_bytes(secrets, bootstrap)
    key, run_id, address = _unpack_secrets(secrets)

    def on_sigterm(signum: int, _frame: object) -> None:
        # Keep stepping: the frontend drains its running requests and then sends SHUTDOWN to all.
        log.info("SIGTERM: draining through the frontend")
        if frontend is not None and frontend.poll() is None:
            frontend.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    options = ExecutorOptions(
        model=config.model,
        dtype=config.dtype,
        weight_format=config.weight_format,
        kv_cache_dtype=config.resolved_kv_dtype,
        num_kv_pages=config.num_kv_pages,
        page_size=config.page_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        num_host_pages=config.num_host_pages,
        device="cuda" if use_cuda else "cpu",
        cuda_graphs=not config.enforce_eager,
        debug_poison_cache=config.debug_poison_kv_cache,
        debug_poison_freed=config.debug_poison_freed_pages,
        debug_skip_clears=config.debug_skip_clears,
    )
    try:
        code = run_executor(options, rank=rank, world_size=world, address=address, key=key, run_id=run_id)
    finally:
        if frontend is not None:
            try:
                frontend_code = frontend.wait(timeout=FRONTEND_GRACE_S)
            except subprocess.TimeoutExpired:
                frontend.kill()
                frontend_code = frontend.wait()
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return frontend_code if frontend is not None and frontend_code else code


def _start_frontend(config: RuntimeConfig, mode: str, job: list[str]) -> tuple[subprocess.Popen[bytes], bytes]:
    read_fd, write_fd = os.pipe()
    command = [
        sys.executable,
        "-m",
        "tp_runtime.frontend",
        "--secrets-fd",
        str(write_fd),
        "--config",
        config.to_json(),
        "--mode",
        mode,
        "--",
        *job,
    ]
    child = subprocess.Popen(command, pass_fds=(write_fd,))
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        secrets = pipe.read()
    if not secrets:
        code = child.wait()
        raise RuntimeError(f"the frontend process exited with code {code} before it was ready")
    return child, secrets


def _broadcast_bytes(payload: bytes, group: object) -> bytes:
    import torch
    import torch.distributed as dist

    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8)
    if payload:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buffer, src=0, group=group)
    return buffer.numpy().tobytes()


def pack_secrets(key: bytes, run_id: str, address: str) -> bytes:
    return b"\n".join((key.hex().encode(), run_id.encode(), address.encode()))


def _unpack_secrets(payload: bytes) -> tuple[bytes, str, str]:
    key_hex, run_id, address = payload.decode().split("\n")
    return bytes.fromhex(key_hex), run_id, address
