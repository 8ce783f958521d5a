"""Runtime configuration: one dataclass built from the command line and handed to every process.

The launcher validates it before any rank starts; the frontend process receives it as JSON on its
command line (it is not secret, and plain JSON keeps every channel free of object serialization).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields

from protocol.errors import TPRuntimeError

DTYPES = ("auto", "bf16", "fp32", "fp16")
# vLLM's --dtype names for the same types.
DTYPE_ALIASES = {"bfloat16": "bf16", "float32": "fp32", "float": "fp32", "half": "fp16", "float16": "fp16"}
KV_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8-e4m3")
KV_DTYPE_ALIASES = {"fp8": "fp8-e4m3", "fp8_e4m3": "fp8-e4m3", "bfloat16": "bf16"}  # vLLM's --kv-cache-dtype names


class ConfigError(TPRuntimeError, ValueError):
    """An option that cannot work; the CLI prints it as one sentence and exits with code 2."""


# The default --num-scheduler-steps. Several forwards per frame divide the control plane's CPU per
# token (docs/control_plane.md): 16 met the served concurrency-1 TPOT target on a 2-core CPU where 8
# did not, and an arrival cuts a frame after the forward running (CUT), so its time to first token
# does not grow with it. A stream's chunks carry up to this many tokens.
DEFAULT_SCHEDULER_STEPS = 16


@dataclass(frozen=True)
class RuntimeConfig:
    model: str
    tensor_parallel_size: int = 1
    dtype: str = "auto"  # resolved by the launcher: bf16 where the hardware has it, else fp32
    weight_format: str = "auto"  # checked by the launcher, resolved by each rank as it loads
    kv_cache_dtype: str = "auto"
    kv_cache_scales: str = "auto"  # fp8: auto, checkpoint, calibrate or a number (executor/kv_scales.py)
    page_size: int = 16
    num_kv_pages: int = 0  # 0: derived from kv_cache_memory
    kv_cache_memory: int = 1 << 30  # bytes per rank for the KV pool, when num_kv_pages is 0
    # vLLM's: the share of the device's memory (on the CPU: of the host's, split among its ranks)
    # that one rank may use for weights, activations and KV together; the KV pool gets what is left.
    # 0: unset (kv_cache_memory sizes the pool).
    gpu_memory_utilization: float = 0.0
    max_num_seqs: int = 64
    max_model_len: int = 0  # 0: the model's context length
    max_num_batched_tokens: int = 512
    swap_space: int = 0  # bytes of host offload buffer per rank; 0 preempts by recompute
    num_host_pages: int = 0  # derived from swap_space by the launcher
    enable_prefix_caching: bool = True
    # Plan step N+1 while step N runs (vLLM's --async-scheduling); off runs every step in series.
    async_scheduling: bool = True
    # Forwards a steady decode step runs on one frame (vLLM's --num-scheduler-steps; scheduler.config).
    # 0: DEFAULT_SCHEDULER_STEPS, at most page_size (tp_runtime.resolve).
    num_scheduler_steps: int = 0
    # The frontend's nice value; None: 10 on the CPU, 0 on CUDA (tp_runtime.bootstrap.frontend_nice).
    frontend_nice: int | None = None
    device: str = "auto"
    enforce_eager: bool = False
    # A step's sample read back once the next forward is queued; None: on CUDA (ExecutorOptions).
    pipelined_readback: bool | None = None
    # --deterministic (or VLLM_BATCH_INVARIANT=1): each request's output independent of its batch,
    # its chunking, the schedule and the TP size (docs/invariance.md).
    deterministic: bool = False
    # Launch across hosts (torchrun's names; docs/deployment.md). One host of nnodes: the options
    # above must be the same on every host, these say where this host stands.
    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 0  # 0: tensor_parallel_size // nnodes
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    advertise_host: str = ""  # "": the address torchrun's rendezvous reaches rank 0's host by
    frame_port: int = 0  # the scheduler's tcp port across hosts; 0: any free port
    frame_key_dir: str = ""  # operator-provisioned keys (`tp-runtime keys DIR`), 0700/0600
    trust_rendezvous_store: bool = False  # keys made per launch, public halves through the store
    shutdown_timeout: float = 20.0  # SIGTERM drain bound; torchrun's grace period must exceed it
    # Recovery under `tp-runtime serve` (tp_runtime/recovery.py): executor group restarts allowed
    # within restart_window seconds (one more ends the service), and how long requests wait for one.
    max_restarts: int = 3
    restart_window: float = 600.0
    recovery_timeout: float = 60.0
    host: str = "127.0.0.1"
    port: int = 8000
    debug_poison_kv_cache: bool = False
    debug_poison_freed_pages: bool = False
    debug_skip_clears: bool = False
    log_level: str = "info"
    seed: int | None = None  # vLLM's --seed: seeds rank 0's generator for requests that bring none
    tokenizer: str = ""  # "": the model's own
    chat_template: str = ""  # a file or the template itself; "": the tokenizer's
    uvicorn_log_level: str = ""  # "": log_level
    max_logprobs: int = 20  # alternatives per token a request may ask for
    # The HTTP server's (docs/http_api.md). The API key is not here: this config travels on a
    # command line, the key in VLLM_API_KEY.
    served_model_name: tuple[str, ...] = ()  # () : the --model path, as vLLM reports it
    max_num_queued_reqs: int = 0  # requests in flight before 429; 0: 8 x max_num_seqs
    max_request_body_size: int = 0  # bytes; 0: derived from the prompt cap
    max_prompt_chars: int = 0  # 0: max_model_len x the longest token's characters
    request_body_timeout: float = 30.0  # seconds for a whole request body to arrive
    request_header_timeout: float = 10.0  # seconds for a request's line and headers to arrive
    timeout_keep_alive: int = 5  # seconds an idle keep-alive connection stays open (uvicorn's)
    require_api_key_for_metrics: bool = False

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def ranks_per_node(self) -> int:
        return self.nproc_per_node or self.tensor_parallel_size // self.nnodes

    @property
    def resolved_kv_dtype(self) -> str:
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RuntimeConfig:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown configuration keys: {sorted(unknown)}")
        return cls(**data)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'1GiB', '512M', '2.5G' or a plain byte count -> bytes (binary units, as vLLM's flags read)."""
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"'{text}' is not a size: write a number of bytes or e.g. 512MiB, 1GiB")
    unit = (match.group(2) or "").upper()[:1]
    return int(float(match.group(1)) * _UNITS[unit])
