"""The body of one torchrun worker: the process group, the bootstrap, one executor, and under plain
torchrun on rank 0 the frontend child and its watch.

Under `tp-runtime serve` the frontend is not rank 0's child: it runs beside node 0's ranks
(tp_runtime/supervisor.py) and names its bootstrap socket in BOOTSTRAP_ENV, where the first rank on
that host asks for this group's run id and keys and broadcasts them (tp_runtime.bootstrap). A failed
group is then killed and restarted, on every host, so a rank keeps no drain of its own: SIGTERM
ends it at once."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from datetime import timedelta

from tp_runtime import frame_keys, hosts, torch_floor
from tp_runtime.bootstrap import (
    BOOTSTRAP_ENV,
    BOOTSTRAP_FD_ENV,
    SUPERVISED_ENV,
    Bootstrap,
    BootstrapRequest,
    KeyMode,
    bootstrap_source,
    broadcast_bytes,
    frontend_nice,
    rank_keys,
    read_bootstrap,
    request_bootstrap,
    spawn_frontend,
)
from tp_runtime.config import ConfigError, RuntimeConfig
from tp_runtime.grammar_vocabulary import grammar_vocabulary
from tp_runtime.launcher import LAUNCHER_PID_ENV, STORE_TIMEOUT_S, check_drain_fits
from tp_runtime.resolve import executor_options, resolve, uses_cuda

log = logging.getLogger("tp_runtime.launch")

BOOTSTRAP_WAIT_S = 150.0  # a supervised rank 0 waits this long for the frontend to open its group
FRONTEND_GRACE_S = 5.0  # rank 0 waits this long for its frontend to exit once its executor has
FRONTEND_GONE_S = 10.0  # longer than an executor's peer timeout: rank 0 then ends on its own
_PR_SET_PDEATHSIG = 1
# A listening socket for the process group's store, bound by a launcher that starts the ranks itself.
STORE_FD_ENV = "TP_RUNTIME_STORE_FD"


def drain_when_parent_dies() -> None:
    """Asks the kernel for SIGTERM when this worker's parent, torchrun's agent, dies.

    torchrun starts each worker in a session of its own and stops its workers only while its agent
    runs: an agent killed by SIGKILL (or the OOM killer) would leave them serving, reparented, with
    the port, the devices and the frontend still held. With SIGTERM at the parent's death a worker
    drains as after a user's SIGTERM (rank 0 passes it to its frontend, which lets running requests
    finish and then sends SHUTDOWN to every rank) and exits. Before the handler is installed SIGTERM
    just ends the worker: there is nothing to drain yet. The kernel ties the signal to the thread
    that forked the worker; torchrun's agent starts its workers from its main thread, which lives as
    long as the agent does."""
    if not sys.platform.startswith("linux"):
        return
    parent = int(os.environ.get(LAUNCHER_PID_ENV) or os.getppid())
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # it died before the request took effect: no signal would come
        os.kill(os.getpid(), signal.SIGTERM)


def run_worker(config: RuntimeConfig, mode: str, job: list[str]) -> int:
    """Body of one torchrun worker: rank 0 also owns the frontend process."""
    import torch.distributed as dist

    from executor.worker import load_executor, serve_executor
    from tp_runtime.heap import freeze_startup_objects

    torch_floor.require_torch()
    drain_when_parent_dies()
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
    supervised = SUPERVISED_ENV in os.environ
    bootstrap_socket = os.environ.get(BOOTSTRAP_ENV)
    source = 0
    if supervised and world > 1:
        source = bootstrap_source(bootstrap_socket is not None and os.environ.get("LOCAL_RANK") == "0", rank, world, bootstrap_group)
    own_pair, client_keys = _exchange_store_keys(rank, world, source) if key_mode == KeyMode.STORE else (None, [])

    # The frontend starts now (under plain torchrun: rank 0's child) or has started beside the ranks
    # (tp-runtime serve and generate); the shard loads meanwhile, and only then does the source rank
    # ask for the frontend's endpoint, so that the frontend's start is not on the way to the first token.
    frontend: subprocess.Popen[bytes] | None = None
    pipe_fd = int(os.environ[BOOTSTRAP_FD_ENV]) if rank == 0 and BOOTSTRAP_FD_ENV in os.environ else None
    if rank == 0 and not supervised and pipe_fd is None:
        if mode == "serve":
            log.warning(
                "the frontend runs as rank 0's child: a rank that dies or hangs ends the service, with no restart "
                "(`tp-runtime serve` restarts the executor group, on one host or across hosts: docs/deployment.md)"
            )
        started = spawn_frontend(config, mode, job, client_keys, frontend_nice(config, use_cuda))
        frontend, pipe_fd = started.process, started.bootstrap_fd
    try:
        loaded = load_executor(executor_options(config, use_cuda), rank=rank, world_size=world, host_group=bootstrap_group)
    except BaseException:
        if frontend is not None:  # it would wait for a rank that never comes
            frontend.kill()
            frontend.wait()
        raise
    payload = b""
    if rank == source and supervised:
        if bootstrap_socket is None:
            payload = Bootstrap(
                error="no rank of this group is on the frontend's host: node 0 of `tp-runtime serve` runs ranks too"
            ).pack()
        else:
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            request = BootstrapRequest(restart, tuple(key.decode() for key in client_keys))
            payload = request_bootstrap(bootstrap_socket, request, BOOTSTRAP_WAIT_S)
    elif pipe_fd is not None:
        payload = read_bootstrap(pipe_fd, frontend)
    if world > 1:
        payload = broadcast_bytes(payload, bootstrap_group, source)
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
    key, curve = rank_keys(info, key_mode, keys, own_pair, rank)
    if not supervised:
        _drain_on_sigterm(frontend)
    if frontend is not None:
        _watch_frontend(frontend, info.address)
    freeze_startup_objects()
    code = 1
    try:
        code = serve_executor(
            loaded, address=info.address, key=key, run_id=info.run_id, curve=curve,
            grammar_vocabulary=functools.partial(grammar_vocabulary, config),
        )
    finally:
        if frontend is not None:
            code = _reap_frontend(frontend, info.address) or code
    if world > 1:
        code = _agree_on_exit(code, bootstrap_group, source)
        dist.destroy_process_group()
    return code


def _exchange_store_keys(rank: int, world: int, source: int) -> tuple[frame_keys.CurvePair, list[bytes]]:
    """With keys through the rendezvous store: this rank's new pair, its public half published,
    and on the source rank every rank's public key, for the frontend."""
    store = store_client()
    own_pair = frame_keys.new_pair()
    frame_keys.publish_client_key(store, rank, own_pair)
    return own_pair, frame_keys.client_keys(store, world) if rank == source else []


def _drain_on_sigterm(frontend: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM keeps the executor stepping: the frontend drains its running requests and then sends
    SHUTDOWN to every rank."""

    def on_sigterm(_signum: int, _frame: object) -> None:
        log.info("SIGTERM: draining through the frontend")
        if frontend is not None and frontend.poll() is None:
            frontend.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def _reap_frontend(frontend: subprocess.Popen[bytes], address: str) -> int:
    """The frontend's exit code, once it has exited (killed after FRONTEND_GRACE_S)."""
    try:
        code = frontend.wait(timeout=FRONTEND_GRACE_S)
    except subprocess.TimeoutExpired:
        frontend.kill()
        code = frontend.wait()
    # The frontend removes its ipc directory as it exits; one that was killed cannot.
    remove_ipc_dir(address)
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

def _agree_on_exit(code: int, group: object, source: int) -> int:
    """Every rank exits with the code of the source rank (the frontend's host's) unless it has a
    failure of its own: a failed launch fails on every host, so that no host's torchrun agent waits
    in its exit barrier for one that failed."""
    import torch
    import torch.distributed as dist

    status = torch.tensor([code], dtype=torch.int32)
    try:
        dist.broadcast(status, src=source, group=group, async_op=True).wait(timedelta(seconds=FRONTEND_GRACE_S * 2))
    except Exception:  # noqa: BLE001 - the source is gone: that is a failure whatever this rank saw
        return code or 1
    theirs = int(status.item())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    first_here = int(os.environ.get("RANK", "0")) - local_rank  # a host's ranks are numbered in a row
    source_here = first_here <= source < first_here + int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if code == 0 and theirs != 0 and local_rank == 0 and not source_here:
        sys.stderr.write(
            f"tp-runtime: error: the launch failed on the host of rank {source}, exit code {theirs}: its error is there\n"
        )
    return code or theirs

def store_client():  # -> torch.distributed.TCPStore, imported late
    """A connection to the store torchrun's rendezvous set up for this launch (MASTER_ADDR:MASTER_PORT)."""
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))

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

    from executor.options import COLLECTIVE_TIMEOUT_S

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else None
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
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
    given = os.environ.get(STORE_FD_ENV)  # the launcher bound it (tp_runtime/local_launch.py): no race for the port
    listen_fd = int(given) if given else hosts.listen_socket(host, port).detach()
    return dist.TCPStore(
        host, port, world, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=listen_fd
    )
