"""The per-rank body of the tensor-parallel tests, run in spawned processes over gloo."""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor.model import TORCH_DTYPES, LlamaModel, load_model
from tests.model.driver import Driver

PROMPTS = {
    0: [5, 70, 33, 99, 100, 101, 7],
    1: [9, 8, 7, 6, 5, 4, 3, 2, 1, 300, 301],
}
DECODE_STEPS = 5


def scenario(model: LlamaModel) -> tuple[list[torch.Tensor | None], dict[int, list[int]]]:
    """Batched prefill of two prompts, then batched greedy decode; the same on every world size."""
    return Driver(model, num_kv_pages=32, page_size=4).greedy(PROMPTS, DECODE_STEPS)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_rank(
    rank: int,
    world_size: int,
    port: int,
    model_dir: str,
    out_dir: str,
    dtype: str,
    weight_format: str,
    compile_mode: str = "off",
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        model = load_model(
            model_dir,
            rank=rank,
            world_size=world_size,
            dtype=TORCH_DTYPES[dtype],
            device=torch.device("cpu"),
            weight_format=weight_format,
            compile_mode=compile_mode,
        )
        logits, generated = scenario(model)
        out = Path(out_dir)
        (out / f"fingerprint{rank}.txt").write_text(model.fingerprint)
        if rank == 0:
            np.save(out / "logits.npy", torch.cat(logits).numpy(), allow_pickle=False)
            (out / "generated.json").write_text(json.dumps(generated))
        else:
            if any(step is not None for step in logits):
                raise RuntimeError(f"rank {rank} returned logits; only rank 0 should")
    finally:
        dist.destroy_process_group()


def run_tp(
    model_dir: Path,
    out_dir: Path,
    world_size: int,
    timeout_s: float = 120.0,
    *,
    dtype: str = "fp32",
    weight_format: str = "dense",
    compile_mode: str = "off",
) -> None:
    """Run `scenario` on `world_size` spawned ranks; kill them all if any hangs or fails."""
    context = mp.start_processes(
        run_rank,
        args=(world_size, free_port(), str(model_dir), str(out_dir), dtype, weight_format, compile_mode),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    join_ranks(context, timeout_s, f"TP={world_size} ranks")


def join_ranks(context: mp.ProcessContext, timeout_s: float, what: str) -> None:
    """Waits for spawned ranks to end; raises what a rank raised, or TimeoutError, after killing
    every rank still running."""
    deadline = time.monotonic() + timeout_s
    try:
        # join() returns after any one rank exits; it raises if that rank failed.
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what} did not finish within {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
