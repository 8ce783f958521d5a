"""Each executor group's endpoint and frame keys, as the frontend opens them: a new run id, a new
HMAC key and a new socket per group, so that a frame of a dead group never passes for one of the new.

- One host: an ipc:// socket in a 0700 directory; the key itself goes to the group's source rank
  (over the bootstrap socket or rank 0's pipe) and on to its peers over the loopback gloo group.
- Across hosts, with the operator's key directories: tcp on --frame-port (any free port if 0), the
  directory's CURVE server certificate admitting the directory's executor keys; the HMAC key is
  derived from the directory's and the run id on both sides (frame_keys.group_frame_key).
- Across hosts, with keys through the rendezvous store: tcp, a CURVE server pair of the group's own;
  the group's ranks make their pairs per process, so the scheduler learns their public keys from
  the source rank's request, admits exactly those, and answers with the HMAC key sealed to each.

Nothing secret crosses the network in cleartext in any of them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

from protocol.auth import new_key
from protocol.curve import ServerCurve
from protocol.transport import SchedulerEndpoint
from tp_runtime import frame_keys, hosts
from tp_runtime.bootstrap import Bootstrap, BootstrapRequest, KeyMode
from tp_runtime.config import ConfigError, RuntimeConfig


@dataclass(frozen=True)
class OpenedGroup:
    """A bound endpoint and what the group's ranks are told of it. `sealer` is set with keys
    through the store: the group's CURVE server pair, which seals the key to each rank that asks."""

    endpoint: SchedulerEndpoint
    bootstrap: Bootstrap
    key: bytes
    sealer: frame_keys.CurvePair | None = None

    def answer(self, request: BootstrapRequest, world: int) -> Bootstrap:
        """The bootstrap for the group whose source rank sent `request`."""
        if self.sealer is None:
            return self.bootstrap
        if len(request.client_keys) != world:
            return Bootstrap(
                error=f"the group's request carries {len(request.client_keys)} executor keys for {world} ranks"
            )
        clients = [key.encode() for key in request.client_keys]
        self.endpoint.admit(frozenset(clients))
        run_id = self.bootstrap.run_id
        sealed = tuple(
            frame_keys.seal_frame_key(self.key, self.sealer, public, run_id, rank).hex() for rank, public in enumerate(clients)
        )
        return replace(self.bootstrap, sealed_keys=sealed)


def tcp_address(config: RuntimeConfig, master_addr: str) -> str:
    ip = hosts.scheduler_address(config.advertise_host, master_addr)
    host = f"[{ip}]" if ":" in ip else ip
    return f"tcp://{host}:{config.frame_port}"


def open_group(config: RuntimeConfig, address: str) -> OpenedGroup:
    """Binds `address` (ipc:// on one host, tcp:// across hosts) under a new run id and key."""
    run_id = uuid.uuid4().hex
    if address.startswith("ipc://"):
        key = new_key()
        endpoint = SchedulerEndpoint(address, key, run_id)
        return OpenedGroup(endpoint, Bootstrap(run_id, endpoint.address, KeyMode.PIPE.value, key.hex()), key)
    if config.frame_key_dir:
        keys = frame_keys.load_key_dir(config.frame_key_dir)
        key = frame_keys.group_frame_key(keys.frame_key, run_id)
        endpoint = SchedulerEndpoint(address, key, run_id, curve=keys.server)
        return OpenedGroup(endpoint, Bootstrap(run_id, endpoint.address, KeyMode.DIRECTORY.value), key)
    if not config.trust_rendezvous_store:
        raise ConfigError("across hosts pass --frame-key-dir or --trust-rendezvous-store (docs/deployment.md)")
    pair, key = frame_keys.new_pair(), new_key()
    # Admits nobody until the group's request names its ranks' keys (OpenedGroup.answer).
    endpoint = SchedulerEndpoint(address, key, run_id, curve=ServerCurve(pair.public, pair.secret, frozenset()))
    bootstrap = Bootstrap(run_id, endpoint.address, KeyMode.STORE.value, server_key=pair.public.decode())
    return OpenedGroup(endpoint, bootstrap, key, sealer=pair)
