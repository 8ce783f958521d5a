"""Bare executors under test: `run_executor` on N ranks with a stand-in model, and no frontend.

The caller owns the scheduler side (a SchedulerEndpoint bound to `address`) and speaks the protocol
itself; this module starts the ranks (torch.distributed over gloo on a free loopback port), knows
each one's pid, and stops them by pid. The model comes from `load`, a "module:function" with
load_model's signature, imported in each rank's process. Each rank runs
`python -m scripts.harness.executors '<spec as JSON>'`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from scripts.harness.processes import ProcessRef, ProcessTracker, free_port, rank_label, spawn, wait_gone

if TYPE_CHECKING:
    from executor.options import ExecutorOptions


@dataclass(frozen=True)
class RankSpec:
    """What one rank's process is told, on its command line."""

    rank: int
    world_size: int
    master_port: int
    address: str
    key_hex: str
    run_id: str
    options: dict[str, object]  # ExecutorOptions' fields
    load: str
    collective_timeout_s: float
    log_level: str


class ExecutorCluster:
    """`world_size` executor processes; a context manager, so that every rank is always stopped.

    options: one ExecutorOptions for all ranks, or a function of the rank (to make ranks disagree).
    Each rank's output goes to log_dir/rank<N>.log, or to this process's when log_dir is None.
    """

    def __init__(
        self,
        world_size: int,
        *,
        address: str,
        key: bytes,
        run_id: str,
        options: ExecutorOptions | Callable[[int], ExecutorOptions],
        load: str,
        log_dir: Path | None = None,
        collective_timeout_s: float = 20.0,
        log_level: str = "INFO",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.world_size = world_size
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen[bytes]] = []
        self._options_of = options if callable(options) else (lambda _rank: options)
        self._spec = dict(
            world_size=world_size,
            address=address,
            key_hex=key.hex(),
            run_id=run_id,
            load=load,
            collective_timeout_s=collective_timeout_s,
            log_level=log_level,
        )
        # One thread per rank: each process gets its share of the cores the way torchrun gives it.
        self._env = {"OMP_NUM_THREADS": "1", **(env or {})}
        self._tracker = ProcessTracker()

    def __enter__(self) -> ExecutorCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ExecutorCluster:
        port = free_port()
        try:
            for rank in range(self.world_size):
                spec = RankSpec(rank=rank, master_port=port, options=asdict(self._options_of(rank)), **self._spec)
                argv = ["-m", "scripts.harness.executors", json.dumps(asdict(spec))]
                process = spawn(argv, cluster_tag=self._tracker.tag, log_path=self.log_path(rank), env=self._env)
                self.processes.append(process)
                ref = ProcessRef.of(process.pid, rank_label(rank))
                if ref is not None:
                    self._tracker.add(ref)
        except BaseException:
            self.stop()
            raise
        return self

    def log_path(self, rank: int) -> Path | None:
        return None if self.log_dir is None else self.log_dir / f"{rank_label(rank)}.log"

    def log(self, rank: int) -> str:
        path = self.log_path(rank)
        return "(rank output is not captured: no log_dir)" if path is None else path.read_text(errors="replace")

    def process_of(self, rank: int) -> ProcessRef:
        return self._tracker.get(rank_label(rank))

    def pids(self) -> dict[int, int]:
        return {rank: process.pid for rank, process in enumerate(self.processes)}

    def signal(self, rank: int, sig: signal.Signals) -> ProcessRef:
        ref = self.process_of(rank)
        if not ref.signal(sig):
            raise ProcessLookupError(f"{ref.label} (pid {ref.pid}) is not running")
        return ref

    def wait_exit(self, rank: int, timeout_s: float) -> int:
        """Rank's exit code; raises subprocess.TimeoutExpired if it still runs after timeout_s."""
        return self.processes[rank].wait(timeout=timeout_s)

    def survivors(self) -> list[ProcessRef]:
        return self._tracker.survivors()

    def rss(self) -> dict[str, int]:
        sizes = {label: ref.rss_bytes() for label, ref in self._tracker.known().items()}
        return {label: size for label, size in sizes.items() if size is not None}

    def stop(self, grace_s: float = 0.0) -> dict[int, int | None]:
        """Waits up to grace_s for the ranks to exit by themselves (after a SHUTDOWN), then SIGKILL,
        by pid, to every rank still alive. Returns rank -> exit code."""
        wait_gone(self.survivors(), grace_s)
        killed = self._tracker.kill_survivors()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        wait_gone(killed, 10.0)
        return {rank: process.returncode for rank, process in enumerate(self.processes)}


def _run_rank(spec: RankSpec) -> None:
    import datetime
    import importlib
    import logging
    import os

    import torch.distributed as dist

    from executor.options import ExecutorOptions
    from executor.worker import run_executor

    logging.basicConfig(level=spec.log_level, stream=sys.stderr, format="%(message)s")
    if spec.world_size > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{spec.master_port}",
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.collective_timeout_s),
        )
    module, _, name = spec.load.partition(":")
    code = run_executor(
        ExecutorOptions(**spec.options),
        rank=spec.rank,
        world_size=spec.world_size,
        address=spec.address,
        key=bytes.fromhex(spec.key_hex),
        run_id=spec.run_id,
        load=getattr(importlib.import_module(module), name),
        # The group is gloo's here, CUDA or not: on the device check's TP=2 (two ranks on one GPU)
        # the cut flags go over the sockets and the tokens through gloo (executor.feedback).
        host_group=dist.group.WORLD if spec.world_size > 1 else None,
    )
    logging.shutdown()
    sys.stdout.flush()
    # Skip interpreter teardown: destroying a gloo group whose peer died can block.
    os._exit(code)


if __name__ == "__main__":
    _run_rank(RankSpec(**json.loads(sys.argv[1])))
