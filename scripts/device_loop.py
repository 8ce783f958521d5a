"""The real executor loop without the HTTP server: the engine and its scheduler in this process,
`world_size` executor processes (scripts/harness/executors.py: gloo between them) on one device.

The device check uses it where the server cannot go: TP=2 on the one GPU (two ranks over gloo,
since NCCL refuses two ranks on one device, and the server's ranks take cuda:LOCAL_RANK), and around
a forward whose timing it records (scripts/device_serving.py). Every rule of the real loop holds:
PREPARE, validation, clears on the model stream before the forward, READY, GO, feedback tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from executor.options import ExecutorOptions
from protocol.auth import new_key
from protocol.transport import SchedulerEndpoint, ipc_address
from scheduler.request import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scripts.harness.executors import ExecutorCluster
from tp_runtime.engine import Engine


@dataclass(frozen=True)
class LoopSpec:
    model: str
    world_size: int = 1
    device: str = "cuda:0"
    dtype: str = "bf16"
    kv_cache_dtype: str = "bf16"
    cuda_graphs: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    pipelined_readback: bool | None = None  # None: on CUDA (ExecutorOptions)
    poison: bool = False  # the cache at allocation and every freed page, 0xFF
    skip_clears: bool = False
    num_kv_pages: int = 40
    page_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    max_model_len: int = 256
    num_host_pages: int = 0
    load: str = "executor.model:load_model"
    env: Mapping[str, str] = field(default_factory=dict)

    def options(self) -> ExecutorOptions:
        return ExecutorOptions(
            model=self.model, num_kv_pages=self.num_kv_pages, page_size=self.page_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len, dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype, weight_format="dense", device=self.device, cuda_graphs=self.cuda_graphs,
            cuda_graph_batch_sizes=self.cuda_graph_batch_sizes, num_host_pages=self.num_host_pages,
            pipelined_readback=self.pipelined_readback,
            debug_poison_cache=self.poison, debug_poison_freed=self.poison, debug_skip_clears=self.skip_clears,
            heartbeat_interval_s=0.5,
        )  # fmt: skip

    def scheduler(self, eos_token_ids: tuple[int, ...] = ()) -> SchedulerConfig:
        return SchedulerConfig(
            num_kv_pages=self.num_kv_pages, page_size=self.page_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            eos_token_ids=eos_token_ids, num_host_pages=self.num_host_pages, enable_prefix_cache=False,
            poison_freed_pages=self.poison, max_inflight_steps=2,
        )  # fmt: skip


@dataclass(frozen=True)
class Generated:
    tokens: tuple[int, ...]
    error: str | None


class Loop:
    """A context manager: the ranks are always stopped (by pid), the endpoint always closed."""

    def __init__(self, spec: LoopSpec, log_dir: Path, run_id: str) -> None:
        self.spec = spec
        self._codes: dict[int, int | None] | None = None
        self.endpoint = SchedulerEndpoint(ipc_address(), new_key(), run_id)
        self.engine = Engine(
            scheduler=Scheduler(spec.scheduler()), endpoint=self.endpoint, world_size=spec.world_size,
            model_name=run_id, max_model_len=spec.max_model_len,
        )  # fmt: skip
        log_dir.mkdir(parents=True, exist_ok=True)
        self.cluster = ExecutorCluster(
            spec.world_size, address=self.endpoint.address, key=self.endpoint._stamp.key, run_id=run_id,
            options=spec.options(), load=spec.load, log_dir=log_dir, log_level="WARNING", collective_timeout_s=120.0,
            env=dict(spec.env),
        )  # fmt: skip

    def __enter__(self) -> Loop:
        try:
            self.cluster.start()
            self.engine.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout_s: float) -> None:
        self.engine.wait_ready(timeout_s)

    def generate(self, prompt: Sequence[int], max_tokens: int) -> Generated:
        stream = self.engine.submit(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        tokens: list[int] = []
        for event in stream:
            tokens.extend(event.token_ids)
            if event.finished:
                return Generated(tuple(tokens), event.error)
        return Generated(tuple(tokens), "the stream ended without a finished event")

    def close(self, grace_s: float = 10.0) -> dict[int, int | None]:
        """Stops the ranks (SHUTDOWN, then SIGKILL by pid after grace_s) and closes the endpoint;
        the exit codes by rank. Once: later calls return the same codes."""
        if self._codes is None:
            self.engine.shutdown("the device check is done")
            self._codes = self.cluster.stop(grace_s=grace_s)
            self.endpoint.close()
        return self._codes

    def rank_logs(self) -> str:
        return "\n".join(f"--- rank {rank}\n{self.cluster.log(rank)[-3000:]}" for rank in range(self.spec.world_size))
