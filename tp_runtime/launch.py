"""Process launch: torchrun workers (one executor per rank) and rank 0's frontend child.

`tp-runtime serve|generate` outside torchrun re-enters itself through torch.distributed's own
launcher (`torch.distributed.run`, c10d rendezvous), so that the canonical `torchrun ... -m
tp_runtime serve` and the convenience command are the same code path. Across hosts the same command
runs on every host (`--nnodes N --node-rank K --master-addr H --master-port P`); the host that the
rendezvous gives global rank 0 runs the frontend, the others only executors.

Where things listen: torch's TCPStore binds every interface whatever host it is given, and gloo
binds the address the host name resolves to. So the launcher hosts the rendezvous store itself, on
a socket bound to loopback (one host) or to --master-addr (host 0 of several), and has torchrun's
agent join it as a client; rank 0 hosts the process group's store the same way on MASTER_ADDR; and
gloo is bound to the interface that reaches MASTER_ADDR. On one host nothing listens beyond
loopback but the HTTP server.

Bootstrap: the frontend (the scheduler) makes the run id and binds its endpoint; on one host it also
makes the HMAC key. It hands them to rank 0 over a private pipe, and rank 0 broadcasts them over the
gloo group. Across hosts the key is not in that message: every process reads it from the operator's
key directory (tp_runtime.frame_keys). The key never travels on a frame socket.

Stopping: SIGTERM drains for at most --shutdown-timeout seconds, and the launcher gives torchrun a
grace period STOP_MARGIN_S longer, so that the drain always ends before torchrun kills the ranks.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING

from tp_runtime import frame_keys, hosts
from tp_runtime.config import ConfigError, RuntimeConfig

if TYPE_CHECKING:
    from executor.model.config import ModelConfig
    from protocol.curve import LaunchKeys

log = logging.getLogger("tp_runtime.launch")

# torch.distributed.elastic waits this long after passing SIGTERM on before it SIGKILLs the ranks,
# unless torchrun's --shutdown-timeout or TORCH_ELASTIC_SHUTDOWN_TIMEOUT says otherwise (torch 2.13:
# LaunchConfig.shutdown_timeout).
TORCHRUN_DEFAULT_GRACE_S = 30
# What a stop takes after the drain: SHUTDOWN to every rank, their exit, the frontend's exit.
STOP_MARGIN_S = 10.0
FRONTEND_GRACE_S = 5.0  # rank 0 waits this long for its frontend to exit once its executor has
FRONTEND_GONE_S = 10.0  # longer than an executor's peer timeout: rank 0 then ends on its own
STORE_TIMEOUT_S = 60.0
RDZV_ID = "tp-runtime"


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


def torchrun_grace_s(config: RuntimeConfig) -> int:
    """The grace period the launcher gives torchrun: the drain plus the stop, at least torch's own."""
    return max(TORCHRUN_DEFAULT_GRACE_S, math.ceil(config.shutdown_timeout + STOP_MARGIN_S))


def check_drain_fits(config: RuntimeConfig) -> None:
    """Under plain torchrun: the drain must end before torchrun's grace period does."""
    raw = os.environ.get("PET_SHUTDOWN_TIMEOUT") or os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    grace = float(raw) if raw else TORCHRUN_DEFAULT_GRACE_S
    if config.shutdown_timeout + STOP_MARGIN_S <= grace:
        return
    needed = math.ceil(config.shutdown_timeout + STOP_MARGIN_S)
    if raw:
        raise ConfigError(
            f"--shutdown-timeout {config.shutdown_timeout:g} does not fit torchrun's grace period of {grace:g} s "
            f"(stopping takes up to {STOP_MARGIN_S:g} s more): give torchrun --shutdown-timeout {needed} or lower ours"
        )
    log.warning(
        "--shutdown-timeout %g needs torchrun's grace period to be at least %d s; torch's default is %d s unless "
        "torchrun was given --shutdown-timeout", config.shutdown_timeout, needed, TORCHRUN_DEFAULT_GRACE_S,
    )


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@contextlib.contextmanager
def _rendezvous(config: RuntimeConfig) -> Iterator[tuple[str, str]]:
    """(rendezvous endpoint, this host's address) for torchrun, with the store listening on the
    endpoint's own address only while the launch runs (host 0 hosts it)."""
    import torch.distributed as dist

    if config.multi_node:
        local_addr = hosts.route_address(config.master_addr, config.master_port)
        endpoint = _host_port(config.master_addr, config.master_port)
        if config.node_rank != 0:
            yield endpoint, local_addr
            return
        store_ip = hosts.resolve(config.master_addr)
        if store_ip != local_addr:
            raise ConfigError(
                f"--node-rank 0 hosts the rendezvous on --master-addr {config.master_addr} ({store_ip}), "
                "which is not an address of this host"
            )
        listener = hosts.listen_socket(store_ip, config.master_port)
    else:
        local_addr = store_ip = "127.0.0.1"
        listener = hosts.listen_socket(store_ip, 0)
        endpoint = _host_port(store_ip, listener.getsockname()[1])
    # The store owns the descriptor from here (libuv closes it); it lives as long as the launch.
    store = dist.TCPStore(
        store_ip, listener.getsockname()[1], is_master=True, multi_tenant=True, wait_for_workers=False,
        timeout=timedelta(seconds=STORE_TIMEOUT_S), master_listen_fd=listener.detach(),
    )
    try:
        yield endpoint, local_addr
    finally:
        del store


def torchrun_argv(config: RuntimeConfig, endpoint: str, local_addr: str, argv: list[str]) -> list[str]:
    return [
        f"--nnodes={config.nnodes}",
        f"--nproc-per-node={config.ranks_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={RDZV_ID}",
        "--rdzv-conf=is_host=false",  # the launcher hosts the store (above), the agent joins it
        f"--local-addr={local_addr}",  # the address rank 0's agent publishes as MASTER_ADDR
        "--max-restarts=0",
        "--monitor-interval=0.2",
        f"--shutdown-timeout={torchrun_grace_s(config)}",
        "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT",  # not SIGTERM: the launcher's (_Stop)
        "-m",
        "tp_runtime",
        *argv,
    ]


def quiet_torchrun(log_level: str) -> None:
    """At --log-level warning or error, the ranks and the frontend say what failed in one sentence;
    torchrun's agent would add its own lines (which process it signalled, which exit code it saw)
    and c10d its C++ warnings. c10d and some of the agent's loggers read these variables when torch
    loads: call this before it does."""
    if log_level in ("warning", "error"):
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        os.environ.setdefault("LOGLEVEL", "CRITICAL")  # the loggers torch.distributed.elastic gives a level
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def launch(config: RuntimeConfig, argv: list[str]) -> int:
    """Starts `python -m tp_runtime <argv>` on this host's ranks through torchrun's launcher."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    # Each rank gets its share of the cores (torchrun would otherwise set 1 and print a banner).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // config.ranks_per_node)))
    # The ranks check their drain against the grace period (check_drain_fits).
    os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(torchrun_grace_s(config))
    # No agent-hosted store for the process group: rank 0 hosts it on MASTER_ADDR (_process_group_store).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    stop = _Stop(config.shutdown_timeout + STOP_MARGIN_S)
    with _rendezvous(config) as (endpoint, local_addr):
        torchrun_args = get_args_parser().parse_args(torchrun_argv(config, endpoint, local_addr, argv))
        try:
            run(torchrun_args)
        except SignalException as exc:
            if stop.forced:
                sys.stderr.write(
                    f"tp-runtime: error: the ranks did not stop within {stop.after_s:g} s of SIGTERM: stopped by force\n"
                )
                return 1
            log.info("stopped by %s", exc.sigval.name)
            return 0
        except ChildFailedError:  # the ranks or the frontend have said why
            return 1
        except RendezvousError as exc:
            sys.stderr.write(f"tp-runtime: error: the rendezvous at {endpoint} failed: {exc}\n")
            return 1
    return 0


class _Stop:
    """SIGTERM to the launcher: the launcher, not torchrun's agent, passes it on to this host's ranks.

    They drain and exit by themselves, so every host's agent sees its ranks succeed and meets the
    others in torchrun's exit barrier; an agent stopped by a signal skips that barrier, and the
    other hosts' agents would wait there for it (torch's exit_barrier_timeout, 300 s). If the ranks
    are still there `after_s` seconds later, or at a second SIGTERM, the launcher hands the stop to
    torchrun (SIGINT: it signals the ranks and SIGKILLs them after its grace period)."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.forced = False
        self._signalled = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, _signum: int, _frame: object) -> None:
        if self._signalled:
            self._force()
            return
        self._signalled = True
        for pid in _child_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        timer = threading.Timer(self.after_s, self._force)
        timer.daemon = True
        timer.start()

    def _force(self) -> None:
        self.forced = True
        os.kill(os.getpid(), signal.SIGINT)


def _child_pids() -> list[int]:
    """This process's children: the ranks torchrun's agent started (it runs in this process)."""
    me, children = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            children.append(int(entry))
    return children


class KeyMode(str, enum.Enum):
    """How the ranks get the frame keys (tp_runtime.frame_keys)."""

    PIPE = "pipe"  # one host: the frontend's key, over the pipe and the loopback gloo group
    DIRECTORY = "directory"  # --frame-key-dir: every process reads its host's copy
    STORE = "store"  # --trust-rendezvous-store: public keys through the store, the key sealed to each rank

    @classmethod
    def of(cls, config: RuntimeConfig, single_host: bool) -> KeyMode:
        if single_host:
            return cls.PIPE
        if config.frame_key_dir:
            return cls.DIRECTORY
        if config.trust_rendezvous_store:
            return cls.STORE
        raise ConfigError("across hosts pass --frame-key-dir or --trust-rendezvous-store (docs/deployment.md)")


@dataclass(frozen=True)
class Bootstrap:
    """What rank 0 broadcasts to every rank once its frontend is up: nothing secret in cleartext.
    `key_hex` is set on one host only (the gloo group is on loopback there); with keys through the
    store the frame key is in `sealed_keys`, one per rank, each sealed to that rank's own key."""

    run_id: str = ""
    address: str = ""
    key_mode: str = ""
    key_hex: str = ""
    server_key: str = ""  # the scheduler's CURVE public key (Z85), with keys through the store
    sealed_keys: tuple[str, ...] = ()
    error: str = ""  # the frontend could not start: every rank exits with this sentence

    def pack(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def unpack(cls, payload: bytes) -> Bootstrap:
        data = json.loads(payload.decode())
        return cls(**{**data, "sealed_keys": tuple(data.get("sealed_keys", ()))})


def run_worker(config: RuntimeConfig, mode: str, job: list[str]) -> int:
    """Body of one torchrun worker: rank 0 also owns the frontend process."""
    import torch.distributed as dist

    from executor.worker import run_executor

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    single_host = os.environ.get("LOCAL_WORLD_SIZE", str(world)) == str(world)
    if world != config.tensor_parallel_size:
        raise ConfigError(f"torchrun started {world} ranks but --tensor-parallel-size is {config.tensor_parallel_size}")
    logging.basicConfig(
        level=config.log_level.upper(), format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"
    )
    if mode == "serve":
        check_drain_fits(config)
    key_mode = KeyMode.of(config, single_host)
    keys = frame_keys.load_key_dir(config.frame_key_dir) if key_mode == KeyMode.DIRECTORY else None
    config = resolve(config)
    use_cuda = uses_cuda(config)
    if world > 1:
        _bind_gloo(single_host)
        _init_process_group("nccl" if use_cuda else "gloo", rank, world, use_cuda)
    bootstrap_group = dist.new_group(backend="gloo") if world > 1 and use_cuda else None
    own_pair, client_keys = None, []
    if key_mode == KeyMode.STORE:
        store = _store_client()
        own_pair = frame_keys.new_pair()
        frame_keys.publish_client_key(store, rank, own_pair)
        if rank == 0:
            client_keys = frame_keys.client_keys(store, world)

    frontend: subprocess.Popen[bytes] | None = None
    payload = b""
    if rank == 0:
        frontend, payload = _start_frontend(config, mode, job, client_keys)
    if world > 1:
        payload = _broadcast_bytes(payload, bootstrap_group)
    info = Bootstrap.unpack(payload)
    if info.error:
        if frontend is not None:
            frontend.wait()
        raise ConfigError(info.error)
    if info.key_mode != key_mode:
        raise ConfigError(
            f"this host was told to key frames by {key_mode.value} and the frontend's host by {info.key_mode}: "
            "every host must be given the same options"
        )
    key, curve = _rank_keys(info, key_mode, keys, own_pair, rank)

    def on_sigterm(signum: int, _frame: object) -> None:
        # Keep stepping: the frontend drains its running requests and then sends SHUTDOWN to all.
        log.info("SIGTERM: draining through the frontend")
        if frontend is not None and frontend.poll() is None:
            frontend.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    if frontend is not None:
        _watch_frontend(frontend, info.address)
    code = 1
    try:
        code = run_executor(
            executor_options(config, use_cuda), rank=rank, world_size=world, address=info.address, key=key,
            run_id=info.run_id, curve=curve,
        )
    finally:
        if frontend is not None:
            try:
                frontend_code = frontend.wait(timeout=FRONTEND_GRACE_S)
            except subprocess.TimeoutExpired:
                frontend.kill()
                frontend_code = frontend.wait()
            code = frontend_code or code
            # The frontend removes its ipc directory as it exits; one that was killed cannot.
            remove_ipc_dir(info.address)
    if world > 1:
        code = _agree_on_exit(code, bootstrap_group)
        dist.destroy_process_group()
    return code


def _watch_frontend(frontend: subprocess.Popen[bytes], address: str) -> None:
    """Ends rank 0 if it outlives its frontend by FRONTEND_GONE_S. After the handshake the executor
    notices a silent scheduler by itself (within its peer timeout); before it, it would wait for a
    WELCOME for as long as weights may take to load."""

    def watch() -> None:
        code = frontend.wait()
        time.sleep(FRONTEND_GONE_S)
        remove_ipc_dir(address)
        sys.stderr.write(f"tp-runtime: error: the frontend exited with code {code}; rank 0 stops too\n")
        sys.stderr.flush()
        os._exit(code or 1)

    threading.Thread(target=watch, name="frontend-watch", daemon=True).start()


def _agree_on_exit(code: int, group: object) -> int:
    """Every rank exits with rank 0's code unless it has a failure of its own: a failed launch fails
    on every host, so that no host's torchrun agent waits in its exit barrier for one that failed."""
    import torch
    import torch.distributed as dist

    status = torch.tensor([code], dtype=torch.int32)
    try:
        dist.broadcast(status, src=0, group=group, async_op=True).wait(timedelta(seconds=FRONTEND_GRACE_S * 2))
    except Exception:  # noqa: BLE001 - rank 0 is gone: that is a failure whatever this rank saw
        return code or 1
    rank_zero = int(status.item())
    if code == 0 and rank_zero != 0 and os.environ.get("LOCAL_RANK") == "0" and os.environ.get("GROUP_RANK") != "0":
        sys.stderr.write(
            f"tp-runtime: error: the launch failed on the host of rank 0 ({os.environ.get('MASTER_ADDR')}), "
            f"exit code {rank_zero}: its error is there\n"
        )
    return code or rank_zero


def _rank_keys(info: Bootstrap, mode: KeyMode, keys: LaunchKeys | None, pair: frame_keys.CurvePair | None, rank: int):  # noqa: ANN202
    """This rank's HMAC key and CURVE client keys (None on one host)."""
    from protocol.curve import ClientCurve

    if mode == KeyMode.PIPE:
        return bytes.fromhex(info.key_hex), None
    if mode == KeyMode.DIRECTORY:
        assert keys is not None and keys.client is not None  # load_key_dir checked
        return keys.frame_key, keys.client
    assert pair is not None
    server_key = info.server_key.encode()
    key = frame_keys.open_frame_key(bytes.fromhex(info.sealed_keys[rank]), pair, server_key, info.run_id, rank)
    return key, ClientCurve(pair.public, pair.secret, server_key)


def _store_client():  # -> torch.distributed.TCPStore, imported late
    """A connection to the store torchrun's rendezvous set up for this launch (MASTER_ADDR:MASTER_PORT)."""
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))


def executor_options(config: RuntimeConfig, use_cuda: bool):  # -> ExecutorOptions, imported late
    from executor.options import ExecutorOptions

    return ExecutorOptions(
        model=config.model,
        dtype=config.dtype,
        weight_format=config.weight_format,
        kv_cache_dtype=config.resolved_kv_dtype,
        kv_cache_scales=config.kv_cache_scales,
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


def remove_ipc_dir(address: str) -> None:
    """Removes the private directory of an ipc:// scheduler address if it is still there: one that
    this user owns with mode 0700, as protocol.transport.ipc_address makes it."""
    if not address.startswith("ipc://"):
        return
    directory = os.path.dirname(address[len("ipc://") :])
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700:
        shutil.rmtree(directory, ignore_errors=True)


def _bind_gloo(single_host: bool) -> None:
    """gloo listens on the interface that reaches MASTER_ADDR (loopback on one host) unless the
    operator chose one with GLOO_SOCKET_IFNAME."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    if single_host:
        address = "127.0.0.1"
    else:
        address = hosts.route_address(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    interface = hosts.interface_of(address)
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def _init_process_group(backend: str, rank: int, world: int, use_cuda: bool) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else None
    timeout = timedelta(seconds=60)
    store = _process_group_store(rank, world)
    if store is None:
        dist.init_process_group(backend, timeout=timeout, device_id=device)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device)


def _process_group_store(rank: int, world: int):  # -> torch.distributed.Store | None, imported late
    """The store the process group bootstraps through. torchrun's agent hosts it unless told not
    to (the launcher does, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE); then rank 0 hosts it here, on
    MASTER_ADDR only, rather than on every interface as init_process_group would."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None  # env:// joins the agent's store
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=STORE_TIMEOUT_S)
    if rank != 0:
        return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    listener = hosts.listen_socket(host, port)
    return dist.TCPStore(
        host, port, world, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=listener.detach()
    )


def _start_frontend(
    config: RuntimeConfig, mode: str, job: list[str], client_keys: list[bytes]
) -> tuple[subprocess.Popen[bytes], bytes]:
    """The frontend process and its packed Bootstrap (one with `error` set if it did not start)."""
    read_fd, write_fd = os.pipe()
    command = [
        sys.executable,
        "-m",
        "tp_runtime.frontend",
        "--bootstrap-fd",
        str(write_fd),
        "--config",
        config.to_json(),
        "--mode",
        mode,
        "--client-keys",  # public keys
        b",".join(client_keys).decode(),
        "--",
        *job,
    ]
    child = subprocess.Popen(command, pass_fds=(write_fd,))
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        payload = pipe.read()
    if not payload:
        code = child.wait()
        return child, Bootstrap(error=f"the frontend process exited with code {code} before it was ready").pack()
    return child, payload


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
