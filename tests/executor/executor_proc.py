"""One executor process for the loop tests: run_executor with the stand-in model.

Usage: python -m tests.executor.executor_proc '<json>' with keys rank, world_size, master_port,
address, key_hex, run_id and options (ExecutorOptions fields). Exits with run_executor's code.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

import torch.distributed as dist

from executor.options import ExecutorOptions
from executor.worker import run_executor
from tests.executor.executor_standin import load_standin


def main() -> None:
    spec = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    rank, world_size = spec["rank"], spec["world_size"]
    if world_size > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{spec['master_port']}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=20),
        )
    options = ExecutorOptions(**spec["options"])
    code = run_executor(
        options,
        rank=rank,
        world_size=world_size,
        address=spec["address"],
        key=bytes.fromhex(spec["key_hex"]),
        run_id=spec["run_id"],
        load=load_standin,
    )
    logging.shutdown()
    sys.stdout.flush()
    # Skip interpreter teardown: destroying a gloo group whose peer died can block.
    os._exit(code)


if __name__ == "__main__":
    main()
