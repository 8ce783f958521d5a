"""The keys that protect frames across hosts, and how each process of a launch gets them.

On one host none of this applies: the frontend makes the HMAC key per launch and it reaches rank 0
over a private pipe and the other ranks over the gloo group, which binds to loopback there; the
frames travel over ipc:// in a 0700 directory.

Across hosts the frames travel over tcp, encrypted and authenticated with CurveZMQ
(protocol.transport's `curve`), and nothing secret may cross the network in cleartext. Two ways:

- Operator keys (`--frame-key-dir DIR`): `tp-runtime keys OUT --hosts h0 h1 ...` makes one
  directory per host (protocol.curve's layout: the shared HMAC key, the scheduler's certificate,
  that host's executor certificate, and the executors' public keys the scheduler admits). The
  operator copies OUT/<host> to each host over a channel they trust. Every host's directory holds
  the scheduler's secret, because torchrun's rendezvous decides which host gets global rank 0 and
  so runs the scheduler. Each process reads its keys from its own disk; only the run id and the
  scheduler's address cross the network. Frames are signed with a key derived from the directory's
  and the run id (`group_frame_key`), so that each executor group of a launch that recovers has a
  key of its own, and none crosses the network.
- Keys through the rendezvous store (`--trust-rendezvous-store`): every executor makes a CurveZMQ
  key pair per launch and puts its public half in torchrun's store; the frontend makes its own pair
  and the HMAC key, admits exactly the executors' public keys, and hands each rank the HMAC key
  sealed to that rank's key (X25519 + HKDF-SHA256 + ChaCha20-Poly1305, from the `cryptography`
  package; CurveZMQ keys are X25519 keys). Only public keys and sealed keys cross the network, but
  whoever can write the store during start-up can put their key in a rank's place: the operator
  trusts the store (and the network to it) for that.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from protocol.curve import CLIENTS_DIR, SERVER, LaunchKeys, load_keys, write_key_directories
from protocol.errors import KeyFileError
from tp_runtime.config import ConfigError

SEALED_NONCE = bytes(12)  # each sealing key is used once: it derives from a key pair made per launch


def create_key_dirs(out: str, hosts: list[str]) -> dict[str, Path]:
    """One key directory per host under `out`, every one able to run the scheduler."""
    try:
        dirs = write_key_directories(out, hosts, scheduler_host=hosts[0])
    except KeyFileError as exc:
        raise ConfigError(str(exc)) from None
    first = dirs[hosts[0]]
    for host in hosts[1:]:
        shutil.copy2(first / f"{SERVER}.key_secret", dirs[host] / f"{SERVER}.key_secret")
        shutil.copytree(first / CLIENTS_DIR, dirs[host] / CLIENTS_DIR)
    return dirs


def load_key_dir(directory: str) -> LaunchKeys:
    """This host's operator keys: the HMAC key, the scheduler's and this host's executor's."""
    try:
        keys = load_keys(directory)
    except KeyFileError as exc:
        raise ConfigError(str(exc)) from None
    if keys.server is None or keys.client is None:
        missing = "the scheduler's secret (server.key_secret)" if keys.server is None else "an executor's (client.key_secret)"
        raise ConfigError(
            f"the key directory {directory} lacks {missing}: any host may run the scheduler and every host runs "
            "executors; make the directories with `tp-runtime keys OUT --hosts ...`"
        )
    return keys


_GROUP_KEY_INFO = b"tp-runtime group frame key|"


def group_frame_key(directory_key: bytes, run_id: str) -> bytes:
    """The HMAC key of the executor group `run_id`, from the key directory's frame key: HKDF-Expand
    (RFC 5869, SHA-256, one block). The directory's key is 32 random bytes, already a pseudorandom key,
    so HKDF's extract step adds nothing. A frame of one group then never verifies under another's key,
    though every host holds only the one file."""
    return hmac.new(directory_key, _GROUP_KEY_INFO + run_id.encode() + b"\x01", hashlib.sha256).digest()


@dataclass(frozen=True)
class CurvePair:
    public: bytes  # Z85, as pyzmq takes it
    secret: bytes


def new_pair() -> CurvePair:
    import zmq

    public, secret = zmq.curve_keypair()
    return CurvePair(public, secret)


def _sealing_key(own_secret: bytes, peer_public: bytes, run_id: str, rank: int) -> bytes:
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError:
        raise ConfigError(
            "--trust-rendezvous-store needs the `cryptography` package (pip install 'tp-runtime[multinode]')"
        ) from None
    from zmq.utils import z85

    shared = X25519PrivateKey.from_private_bytes(z85.decode(own_secret)).exchange(
        X25519PublicKey.from_public_bytes(z85.decode(peer_public))
    )
    info = f"tp-runtime frame key|{run_id}|rank {rank}".encode()
    return HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(shared)


def seal_frame_key(key: bytes, server: CurvePair, client_public: bytes, run_id: str, rank: int) -> bytes:
    """The HMAC key sealed to one rank: only the holder of that rank's secret can open it."""
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    sealing = _sealing_key(server.secret, client_public, run_id, rank)
    return ChaCha20Poly1305(sealing).encrypt(SEALED_NONCE, key, run_id.encode())


def open_frame_key(sealed: bytes, client: CurvePair, server_public: bytes, run_id: str, rank: int) -> bytes:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    sealing = _sealing_key(client.secret, server_public, run_id, rank)
    try:
        return ChaCha20Poly1305(sealing).decrypt(SEALED_NONCE, sealed, run_id.encode())
    except InvalidTag:
        raise ConfigError(
            f"rank {rank} cannot open the frame key sealed to it: the rendezvous store gave the frontend another key "
            "than this rank's (has someone else written to the store?)"
        ) from None


def store_prefix() -> str:
    """Keys of this launch in torchrun's store, apart from other launches and restarts sharing it."""
    return f"tp-runtime/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def publish_client_key(store, rank: int, pair: CurvePair) -> None:  # noqa: ANN001 (torch.distributed.Store)
    store.set(f"{store_prefix()}/client/{rank}", pair.public)


def client_keys(store, world: int) -> list[bytes]:  # noqa: ANN001 (torch.distributed.Store)
    """Every rank's public key, in rank order; waits for the ranks that have not published yet, as
    long as the store's timeout."""
    keys = []
    for rank in range(world):
        try:
            keys.append(bytes(store.get(f"{store_prefix()}/client/{rank}")))
        except Exception as exc:  # noqa: BLE001 - torch raises DistStoreError, a RuntimeError, or a timeout
            raise ConfigError(
                f"rank {rank} put no key in the rendezvous store ({exc}): every host must be given "
                "--trust-rendezvous-store"
            ) from None
    return keys
