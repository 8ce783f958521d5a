"""How every rank learns the token a continuing row sampled: rank 0 broadcasts the ids, or every
rank samples the same token itself, which needs the whole logits row on every rank (the LM head is
split by vocabulary: an all-gather of the shards).

    python scripts/bench_feedback.py [--world 2] [--batches 1,8,32] [--vocab 49152] [--iters 200]

Prints JSON: per batch size, the median time of one broadcast of B int32 ids from rank 0 and of one
all-gather of B x vocab/world float32 logits, over gloo between `--world` processes on this host,
side by side in one run. The executors broadcast (executor/steps.py); this is the measurement that
chose it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, init_file: str, args: argparse.Namespace, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for batch in args.batches:
        ids = torch.zeros(batch, dtype=torch.int32)
        shard = torch.randn(batch, args.vocab // world)
        gathered = [torch.empty_like(shard) for _ in range(world)]
        times: dict[str, list[float]] = {"broadcast_ids": [], "all_gather_logits": []}
        for i in range(args.iters):
            # Alternate the two so that a drift of the machine's load falls on both alike.
            for name in (("broadcast_ids", "all_gather_logits") if i % 2 else ("all_gather_logits", "broadcast_ids")):
                dist.barrier()
                t0 = time.perf_counter()
                if name == "broadcast_ids":
                    dist.broadcast(ids, src=0)
                else:
                    dist.all_gather(gathered, shard)
                times[name].append(time.perf_counter() - t0)
        results[batch] = {name: round(statistics.median(v) * 1e6, 1) for name, v in times.items()}
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8, 32])
    p.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary by default")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_rank, args=(r, args.world, init_file, args, out)) for r in range(args.world)]
        for proc in procs:
            proc.start()
        results = out.get(timeout=600)
        for proc in procs:
            proc.join()
    report = {
        "world": args.world,
        "vocab": args.vocab,
        "median_us": {str(b): r for b, r in results.items()},
        "all_gather_over_broadcast": {str(b): round(r["all_gather_logits"] / r["broadcast_ids"], 1) for b, r in results.items()},
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
