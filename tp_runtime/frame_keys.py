"""The keys that protect frames, and where each process of a launch finds them.

On one host the frontend makes the HMAC key per launch; it reaches rank 0 over a private pipe and
the other ranks over the gloo group, which binds to loopback there. Across hosts nothing secret may
cross the network in cleartext, so the key material is on each host before the launch: the operator
makes a key directory once (`tp-runtime keys DIR`) and copies it to every host over a channel they
trust (scp, a secrets manager). Each process then reads the HMAC key and its CurveZMQ keys from its
own disk; only the run id and the scheduler's address travel over the network.

The directory (mode 0700, every file 0600, owned by the user who runs the launch):
  frame.key                          32 random bytes: the HMAC key of every frame
  server.key, server.key_secret      the scheduler's CurveZMQ certificate (pyzmq's zmq.auth format)
  client.key, client.key_secret      the executors' CurveZMQ certificate
Every host holds the server's secret too, because torchrun's rendezvous decides which host gets
global rank 0, and so runs the scheduler.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from protocol.auth import KEY_FILE_NAME, read_key_file, write_key_file
from protocol.errors import ProtocolError
from tp_runtime.config import ConfigError

SERVER_CERT = "server"
CLIENT_CERT = "client"


@dataclass(frozen=True)
class CurvePair:
    """A CurveZMQ key pair, Z85-encoded as pyzmq takes it."""

    public: bytes
    secret: bytes


@dataclass(frozen=True)
class ProvisionedKeys:
    hmac_key: bytes
    server: CurvePair  # the scheduler's: its secret serves, its public half is what clients trust
    client: CurvePair  # every executor's: the scheduler admits this public key and no other


def create_key_dir(directory: str) -> None:
    """Makes a fresh key directory; refuses one that exists (keys are never silently replaced)."""
    import zmq.auth

    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        raise ConfigError(f"{directory} already exists: give a new directory, keys are never overwritten") from None
    except OSError as exc:
        raise ConfigError(f"cannot make the key directory {directory}: {exc.strerror}") from None
    os.chmod(directory, 0o700)  # whatever the umask
    write_key_file(directory)
    for name in (SERVER_CERT, CLIENT_CERT):
        public_file, secret_file = zmq.auth.create_certificates(directory, name)
        for path in (public_file, secret_file):
            os.chmod(path, 0o600)


def _check_private(path: str, *, directory: bool) -> None:
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    if directory != stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{path} must be a {'directory' if directory else 'file'}")
    if info.st_uid != os.geteuid():
        raise ConfigError(f"{path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()})")
    if info.st_mode & 0o077:
        wanted = "0700" if directory else "0600"
        raise ConfigError(f"{path} has mode {info.st_mode & 0o777:o}; others may read it, it must be {wanted}")


def _load_pair(directory: str, name: str) -> CurvePair:
    import zmq.auth

    path = os.path.join(directory, f"{name}.key_secret")
    _check_private(path, directory=False)
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a CurveZMQ secret certificate: {exc}") from None
    if not secret:
        raise ConfigError(f"{path} holds no secret key")
    return CurvePair(public=public, secret=secret)


def load_key_dir(directory: str) -> ProvisionedKeys:
    """The keys of a directory made by create_key_dir, refusing one that others can read."""
    _check_private(directory, directory=True)
    key_path = os.path.join(directory, KEY_FILE_NAME)
    _check_private(key_path, directory=False)
    try:
        hmac_key = read_key_file(key_path)
    except ProtocolError as exc:
        raise ConfigError(exc.message) from None
    return ProvisionedKeys(hmac_key, _load_pair(directory, SERVER_CERT), _load_pair(directory, CLIENT_CERT))
