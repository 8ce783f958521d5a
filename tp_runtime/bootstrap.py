"""Bootstrap: how the ranks learn the frontend's endpoint, the run id and their frame keys.

The frontend (the scheduler) makes the run id and binds its endpoint; on one host it also makes the
HMAC key. It hands them to one rank (the source: over a private pipe to rank 0, its parent, under
plain torchrun; over the frontend's bootstrap socket under `tp-runtime serve`), which broadcasts them
over the gloo group. Across hosts the key is not in that message: every process derives it from the
operator's key directory and the run id, or gets it sealed to its own key (tp_runtime.frame_keys).
The key never travels on a frame socket.

Under `tp-runtime serve` across hosts the frontend runs on node 0, the host of the rendezvous, but
c10d numbers the hosts by address, so global rank 0 may be on another host: the source is the first
rank that can reach the bootstrap socket (`bootstrap_source`).
"""

from __future__ import annotations

import enum
import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from tp_runtime import frame_keys
from tp_runtime.config import ConfigError, RuntimeConfig

if TYPE_CHECKING:
    from protocol.curve import LaunchKeys

# Under `tp-runtime serve` the launcher starts the frontend beside the ranks and names its bootstrap
# socket here (tp_runtime/group_broker.py); under plain torchrun it is unset and rank 0 starts the
# frontend as its child.
BOOTSTRAP_ENV = "TP_RUNTIME_BOOTSTRAP"
# Under `tp-runtime generate` on one host the launcher starts the frontend beside the ranks it starts
# itself (tp_runtime/local_launch.py) and hands rank 0 the read end of the frontend's pipe: its number.
BOOTSTRAP_FD_ENV = "TP_RUNTIME_BOOTSTRAP_FD"
# Under `tp-runtime serve`, on every host: the executor group is restarted when it fails (on node 0,
# BOOTSTRAP_ENV names the frontend's socket; on the others there is none), so no rank starts a
# frontend of its own nor drains at SIGTERM.
SUPERVISED_ENV = "TP_RUNTIME_SUPERVISED"


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
    """What the source rank broadcasts to every rank once the frontend is up: nothing secret in cleartext.
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

# With the overlap the frontend plans, encodes and streams while the model runs. On the CPU the two
# share the cores, and the forward ran 16.6 ms a step beside a frontend at nice 0 against 14.2 ms at
# nice 10 (bench_serving at concurrency 1, docs/reports.md): the frontend's work has a whole forward
# to get done in, the forward has no slack.
CPU_FRONTEND_NICE = 10


def frontend_nice(config: RuntimeConfig, use_cuda: bool) -> int:
    if config.frontend_nice is not None:
        return config.frontend_nice
    return 0 if use_cuda else CPU_FRONTEND_NICE


@dataclass(frozen=True)
class FrontendStart:
    """A frontend process just started, and the read end of the pipe its Bootstrap comes back on."""

    process: subprocess.Popen[bytes]
    bootstrap_fd: int


def frontend_arguments(bootstrap_fd: int, config: RuntimeConfig, mode: str, job: list[str], client_keys: list[bytes]) -> list[str]:
    """What rank 0 passes `python -m tp_runtime.frontend` (tp_runtime.frontend.arguments parses it)."""
    return [
        "--bootstrap-fd",
        str(bootstrap_fd),
        "--config",
        config.to_json(),
        "--mode",
        mode,
        # Attached with "=": a Z85 key may begin with "-", and argparse takes a separate value that
        # does for an option (a frontend that exited 2 in about one start in 85).
        "--client-keys=" + b",".join(client_keys).decode(),
        "--",
        *job,
    ]


def spawn_frontend(
    config: RuntimeConfig, mode: str, job: list[str], client_keys: list[bytes], nice: int = 0, new_session: bool = False
) -> FrontendStart:
    """Starts the frontend process and returns at once: whoever needs the endpoint reads it later
    (read_bootstrap), so that the frontend's start runs beside the ranks' load rather than before it."""
    read_fd, write_fd = os.pipe()
    command = [sys.executable, "-m", "tp_runtime.frontend", *frontend_arguments(write_fd, config, mode, job, client_keys)]
    try:
        child = subprocess.Popen(
            command, pass_fds=(write_fd,), preexec_fn=(lambda: os.nice(nice)) if nice else None,
            start_new_session=new_session,
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return FrontendStart(child, read_fd)


def write_bootstrap(fd: int, bootstrap: Bootstrap) -> bool:
    """The frontend's side of read_bootstrap: the Bootstrap on its pipe (closes fd); False when
    whoever waits for it died first, for the caller to say so in a sentence, not a traceback."""
    try:
        with os.fdopen(fd, "wb") as pipe:
            pipe.write(bootstrap.pack())
    except BrokenPipeError:
        return False
    return True


def read_bootstrap(fd: int, frontend: subprocess.Popen[bytes] | None = None) -> bytes:
    """The packed Bootstrap a frontend writes on its pipe (one with `error` set if it exited first;
    with its exit code where `frontend` is this process's child). Closes fd."""
    with os.fdopen(fd, "rb") as pipe:
        payload = pipe.read()
    if payload:
        return payload
    code = f" with code {frontend.wait()}" if frontend is not None else ""
    return Bootstrap(error=f"the frontend process exited{code} before it was ready").pack()

@dataclass(frozen=True)
class BootstrapRequest:
    """What the source rank of a supervised group asks the frontend with: the group's restart count,
    and with keys through the rendezvous store every rank's CURVE public key (Z85), in rank order,
    which the frontend admits and seals the group's frame key to."""

    restart: int
    client_keys: tuple[str, ...] = ()

    def pack(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def unpack(cls, payload: bytes) -> BootstrapRequest:
        data = json.loads(payload.decode())
        keys = data.get("client_keys", []) if isinstance(data, dict) else None
        restart = data.get("restart") if isinstance(data, dict) else None
        if not isinstance(restart, int) or restart < 0 or not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError(f"a malformed bootstrap request: {payload[:200]!r}")
        return cls(restart, tuple(keys))


def request_bootstrap(path: str, request: BootstrapRequest, timeout_s: float) -> bytes:
    """The source rank of a supervised group: its packed Bootstrap from the frontend's bootstrap
    socket (one with `error` set if the frontend cannot be reached or opens no group in time)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.sendall(request.pack() + b"\n")
            reply = sock.makefile("rb").readline()
    except OSError as exc:
        return Bootstrap(error=f"cannot reach the frontend's bootstrap socket {path}: {exc}").pack()
    return reply.strip() or Bootstrap(error="the frontend closed the bootstrap socket without an answer").pack()


def bootstrap_source(asks: bool, rank: int, world: int, group: object) -> int:
    """The rank every rank takes the bootstrap from: the lowest that `asks` (it can reach the
    frontend), agreed by an all-reduce; rank 0 where none does (under plain torchrun rank 0 starts
    the frontend itself)."""
    import torch
    import torch.distributed as dist

    vote = torch.tensor([rank if asks else world], dtype=torch.int64)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group)
    source = int(vote.item())
    return 0 if source == world else source


def broadcast_bytes(payload: bytes, group: object, src: int = 0) -> bytes:
    import torch
    import torch.distributed as dist

    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8)
    if payload:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buffer, src=src, group=group)
    return buffer.numpy().tobytes()

def rank_keys(info: Bootstrap, mode: KeyMode, keys: LaunchKeys | None, pair: frame_keys.CurvePair | None, rank: int):
    """This rank's HMAC key and CURVE client keys (None on one host)."""
    from protocol.curve import ClientCurve

    if mode == KeyMode.PIPE:
        return bytes.fromhex(info.key_hex), None
    if mode == KeyMode.DIRECTORY:
        assert keys is not None and keys.client is not None  # load_key_dir checked
        return frame_keys.group_frame_key(keys.frame_key, info.run_id), keys.client
    assert pair is not None
    server_key = info.server_key.encode()
    key = frame_keys.open_frame_key(bytes.fromhex(info.sealed_keys[rank]), pair, server_key, info.run_id, rank)
    return key, ClientCurve(pair.public, pair.secret, server_key)
