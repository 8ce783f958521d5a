"""Key material for frames that cross hosts: CurveZMQ certificates and the frame key, from files.

On tcp:// the scheduler's socket is a CURVE server that admits only the executors' public keys it
was given, and every executor is a CURVE client that pins the scheduler's public key: frames are
encrypted, and a peer without an admitted key never completes the ZeroMQ handshake. The HMAC frame
key still signs every frame. ipc:// on one host needs none of this (the socket sits in a mode-0700
directory, and the key comes over a private pipe; protocol.auth).

A key directory holds, for one host, what that host needs (zmq certificate files, which
zmq.auth.create_certificates writes and zmq.auth.load_certificate reads):

    frame.key            the HMAC frame key, 32 bytes (every host)
    server.key           the scheduler's public certificate (every host)
    server.key_secret    the scheduler's secret certificate (the host that runs the frontend only)
    client.key_secret    this host's executor certificate (every host that runs executors)
    clients/*.key        the executors' public certificates the scheduler admits (the frontend's host)

Secret files (frame.key and *.key_secret) must be owned by the user and readable by nobody else
(mode 0600 or stricter): anything else is refused with a KeyFileError naming the file.
`write_key_directories` makes a consistent set, one directory per host, for the operator to copy.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

from protocol.auth import KEY_BYTES, new_key
from protocol.errors import KeyFileError

FRAME_KEY = "frame.key"
SERVER = "server"
CLIENT = "client"
CLIENTS_DIR = "clients"
ZAP_DOMAIN = "tp-runtime"


@dataclass(frozen=True)
class ServerCurve:
    """What the scheduler's endpoint needs: its key pair and the client keys it admits (Z85)."""

    public_key: bytes
    secret_key: bytes
    allowed_clients: frozenset[bytes]


@dataclass(frozen=True)
class ClientCurve:
    """What an executor's endpoint needs: its key pair and the scheduler's public key (Z85)."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes


@dataclass(frozen=True)
class LaunchKeys:
    """One host's key directory, loaded. `server` is None where the directory has no scheduler
    secret, `client` None where it has no executor secret."""

    frame_key: bytes
    server: ServerCurve | None
    client: ClientCurve | None


def _check_private(path: Path) -> None:
    try:
        info = path.stat()
    except OSError as exc:
        raise KeyFileError(f"cannot read the secret key file {path}: {exc.strerror}") from exc
    if info.st_uid != os.geteuid():
        raise KeyFileError(f"the secret key file {path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()})")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise KeyFileError(
            f"the secret key file {path} has mode {mode:04o}: group or others can read it; "
            f"make it private with `chmod 600 {path}`"
        )


def _load_certificate(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    if secret:
        _check_private(path)
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"{path} is not a readable zmq certificate: {exc}") from exc
    if public is None or len(public) != 40 or (secret and (secret_key is None or len(secret_key) != 40)):
        raise KeyFileError(f"{path} does not hold a Z85 CURVE {'secret' if secret else 'public'} key")
    return public, secret_key


def _load_frame_key(path: Path) -> bytes:
    _check_private(path)
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise KeyFileError(f"the frame key file {path} holds {len(key)} bytes, not {KEY_BYTES}")
    return key


def load_keys(directory: str | os.PathLike[str]) -> LaunchKeys:
    """Load one host's key directory (the layout in this module's docstring)."""
    root = Path(directory)
    if not root.is_dir():
        raise KeyFileError(f"the key directory {root} does not exist")
    server_public, _ = _load_certificate(root / f"{SERVER}.key", secret=False)
    server: ServerCurve | None = None
    if (root / f"{SERVER}.key_secret").exists():
        public, secret = _load_certificate(root / f"{SERVER}.key_secret", secret=True)
        if public != server_public:
            raise KeyFileError(f"{root / (SERVER + '.key_secret')} does not belong to {root / (SERVER + '.key')}")
        clients = sorted((root / CLIENTS_DIR).glob("*.key"))
        if not clients:
            raise KeyFileError(f"{root / CLIENTS_DIR} holds no executor public keys (*.key): the scheduler would admit nobody")
        allowed = frozenset(_load_certificate(path, secret=False)[0] for path in clients)
        server = ServerCurve(public, secret, allowed)
    client: ClientCurve | None = None
    if (root / f"{CLIENT}.key_secret").exists():
        public, secret = _load_certificate(root / f"{CLIENT}.key_secret", secret=True)
        client = ClientCurve(public, secret, server_public)
    return LaunchKeys(_load_frame_key(root / FRAME_KEY), server, client)


def _write_private(path: Path, data: bytes) -> None:
    # O_EXCL: never reuse (or follow a planted link to) a file someone else made.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _new_certificate(directory: Path, name: str) -> tuple[Path, Path]:
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)  # pyzmq writes both files with the process's umask
    return Path(public), Path(secret)


def write_key_directories(out: str | os.PathLike[str], hosts: Sequence[str], scheduler_host: str) -> dict[str, Path]:
    """Make one key directory per host under `out` (which must not exist yet), sharing one frame
    key and one scheduler certificate, with one executor certificate per host; the scheduler's
    host admits every host's executor key. Returns each host's directory, to copy to that host."""
    if scheduler_host not in hosts or len(set(hosts)) != len(hosts):
        raise KeyFileError(f"hosts {list(hosts)} must be distinct and include the scheduler's host {scheduler_host!r}")
    if any(not h or "/" in h or h.startswith(".") for h in hosts):
        raise KeyFileError(f"host names {list(hosts)} must be usable as directory names")
    root = Path(out)
    try:
        root.mkdir(mode=0o700, parents=True)
    except FileExistsError as exc:
        raise KeyFileError(f"{root} exists already: key directories are never overwritten") from exc
    staging = root / ".staging"
    staging.mkdir(mode=0o700)
    server_public, server_secret = _new_certificate(staging, SERVER)
    frame_key = new_key()
    dirs: dict[str, Path] = {}
    for host in hosts:
        d = root / host
        d.mkdir(mode=0o700)
        _write_private(d / FRAME_KEY, frame_key)
        (d / f"{SERVER}.key").write_bytes(server_public.read_bytes())
        public, secret = _new_certificate(d, CLIENT)
        public.rename(staging / f"{host}.key")
        dirs[host] = d
    own = dirs[scheduler_host]
    _write_private(own / f"{SERVER}.key_secret", server_secret.read_bytes())
    (own / CLIENTS_DIR).mkdir(mode=0o700)
    for host in hosts:
        (staging / f"{host}.key").rename(own / CLIENTS_DIR / f"{host}.key")
    server_public.unlink()
    server_secret.unlink()
    staging.rmdir()
    return dirs
