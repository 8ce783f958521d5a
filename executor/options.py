"""Per-executor settings: what the CLI maps its flags onto and what `run_executor` needs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from executor.kv_scales import KVScaleError, parse_scales_option
from protocol.errors import TPRuntimeError
from protocol.frames import KVDtype

MODEL_DTYPES = ("fp32", "bf16", "fp16")
# dense: every matrix in the model dtype; int4: GGUF 4-bit matrices stay 4-bit; mixed: both copies,
# int4 for steps of few rows; auto: mixed where the int4 kernel is fast (docs/model.md).
WEIGHT_FORMATS = ("auto", "dense", "int4", "mixed")
DEVICES = ("auto", "cpu", "cuda")
# The process group's timeout (tp_runtime.worker_process): a collective whose peer stays silent
# fails after it, and so does a read of rank 0's feedback (executor.feedback).
COLLECTIVE_TIMEOUT_S = 60.0


# The model thread's orders by name, as pipelined_readback sets them (executor/steps.py): each sample
# read back once the next forward is queued (a CUDA device's), or as it is drawn (the CPU's).
READBACK_ORDERS = {"pipelined": True, "at-once": False}


class OptionsError(TPRuntimeError, ValueError):
    """An executor option is out of range or names something that does not exist."""


@dataclass(frozen=True)
class ExecutorOptions:
    model: str
    num_kv_pages: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    dtype: str = "bf16"
    weight_format: str = "auto"
    kv_cache_dtype: str = "bf16"
    # fp8 KV: auto, checkpoint, calibrate or a number (executor/kv_scales.py).
    kv_cache_scales: str = "auto"
    page_size: int = 16
    num_host_pages: int = 0
    device: str = "auto"  # auto: cuda:LOCAL_RANK when CUDA is available, else the CPU
    cuda_graphs: bool = True
    # Decode batch sizes captured as CUDA graphs; a decode step pads up to the next one.
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    # A step's sample taken to the host only once the next forward is queued (executor/steps.py);
    # None: on a CUDA device, whose forwards run asynchronously. False keeps the CPU's order there.
    pipelined_readback: bool | None = None
    # Fault injection (DESIGN.md), all off by default.
    debug_poison_cache: bool = False  # fill the whole cache with 0xFF at allocation
    debug_poison_freed: bool = False  # honour Prepare.poison_pages (pages back in the free pool)
    debug_skip_clears: bool = False  # ignore Prepare.cleared_pages
    # Batch- and TP-size-invariant output (docs/invariance.md): one kernel per matrix at every row
    # count, the eager runner, attention in fixed blocks, TP=1 adding TP=2's partial sums.
    deterministic: bool = False
    # Seeds rank 0's default generator, which samples the rows of requests that bring no seed of
    # their own (vLLM's --seed); None: seeded by torch from the OS.
    seed: int | None = None
    # A rank sends a frame at least this often (a heartbeat only when nothing else went). The
    # frontend calls a rank stopped after 1.5 s without one (tp_runtime.step_loop.EngineTimeouts),
    # and each heartbeat costs its engine thread ~0.25 ms, cold (docs/control_plane.md, fourteenth
    # sitting).
    heartbeat_interval_s: float = 0.5
    # Silence from the scheduler for this long, while idle, ends the executor.
    peer_timeout_s: float = 5.0
    # How long to wait for WELCOME after HELLO: other ranks may still be loading weights.
    handshake_timeout_s: float = 600.0
    # After SHUTDOWN or scheduler silence, how long a step may go on before the process ends without
    # it (a collective whose peer has gone would otherwise hold it until the collective's timeout).
    stuck_grace_s: float = 3.0

    def fingerprint(self) -> str:
        """A digest of every option, but the device: the ranks of one launch must agree on all of them
        (the device differs by rank: cuda:LOCAL_RANK)."""
        shared = {k: v for k, v in asdict(self).items() if k != "device"}
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]

    def __post_init__(self) -> None:
        positive = {
            "num_kv_pages": self.num_kv_pages,
            "page_size": self.page_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
        }
        for name, value in positive.items():
            if value < 1:
                raise OptionsError(f"{name} must be at least 1, got {value}")
        if self.num_host_pages < 0:
            raise OptionsError(f"num_host_pages must be >= 0, got {self.num_host_pages}")
        if self.dtype not in MODEL_DTYPES:
            raise OptionsError(f"dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise OptionsError(
                f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weight_format!r}"
            )
        kv_dtypes = [d.value for d in KVDtype]
        if self.kv_cache_dtype not in kv_dtypes:
            raise OptionsError(
                f"kv_cache_dtype must be one of {', '.join(kv_dtypes)}, got {self.kv_cache_dtype!r}"
            )
        try:
            parse_scales_option(self.kv_cache_scales)
        except KVScaleError as exc:
            raise OptionsError(str(exc)) from None
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise OptionsError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.deterministic and self.device.startswith("cuda"):
            raise OptionsError("the deterministic mode runs on the CPU only: its kernels are the CPU's")
        if not self.cuda_graph_batch_sizes or min(self.cuda_graph_batch_sizes) < 1:
            raise OptionsError(
                f"cuda_graph_batch_sizes must be positive sizes, got {self.cuda_graph_batch_sizes}"
            )
        for name in ("heartbeat_interval_s", "peer_timeout_s", "handshake_timeout_s", "stuck_grace_s"):
            if getattr(self, name) <= 0:
                raise OptionsError(f"{name} must be positive, got {getattr(self, name)}")
        if self.peer_timeout_s <= self.heartbeat_interval_s:
            raise OptionsError(
                f"peer_timeout_s ({self.peer_timeout_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), or a live scheduler would look dead"
            )
