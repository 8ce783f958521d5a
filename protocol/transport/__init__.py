"""A thin pyzmq shell around the codec: the scheduler's ROUTER and each executor's DEALER.

Delivery is reliable: ROUTER_MANDATORY makes a send to a peer that is not connected raise instead of
vanishing, and unlimited high-water marks mean a slow peer queues frames rather than losing them.
Both ends stamp version, layout, run id and seq on send; on receive they check the MAC (codec) and
the replay counter. What a frame means (its envelope against the negotiated version, its step, its
type in the current state) is protocol.conversation's business, not the transport's.

Who is who on the scheduler's socket. The ROUTER gives every connection a routing id of its own
making; executors set none. A connection becomes rank r's when its first authenticated frame is a
HELLO saying rank r (and r has no live connection yet); its frames are attributed to r from then on.
A peer-chosen identity would not do: a stranger that connected first with identity "rank-1" would
silently mute the real rank 1 (libzmq keeps the first of two equal identities and drops the other's
messages; ROUTER_HANDOVER instead lets a later stranger take the identity over), and "rank-01" would
be read as rank 1. So anything that is not one of the launched ranks (a connection that sends
nothing, garbage, a frame whose MAC fails, an authenticated frame before a HELLO) is logged, counted
in `peer_stats()` and ignored: it never reaches the caller, never aborts a step, never ends the
service. A frame with a good MAC on a rank's connection that fails a later check is that rank's
doing, and is handed to the caller as a Received with its error.

Closed connections are watched with a socket monitor (EVENT_ACCEPTED / EVENT_DISCONNECTED, which
carry the connection's file descriptor) matched with each rank's first frame's ZMQ_SRCFD, so that
`disconnected_ranks()` says which launched rank's connection closed. ZMQ_ROUTER_NOTIFY would give
this directly, but it is a draft option: with pyzmq 27.3's bundled libzmq 4.3.5 (draft API off)
setting it fails with EINVAL (docs/protocol.md).

On tcp:// across hosts pass `curve` (protocol.curve): the scheduler is a CURVE server that admits only
the given executor keys (ZAP, with ZAP_ENFORCE_DOMAIN so that no handler means no admission), and an
executor pins the server's key. A peer that fails the CURVE handshake never gets a frame through.

One module a concept: `ipc` (private ipc:// directories), `sockets` (the options both socket kinds
share), `stamp` (the envelope each endpoint stamps, and its replay guard), `waker` (ending another
thread's poll), `scheduler_endpoint` and `executor_endpoint`.
"""

from protocol.transport.executor_endpoint import ExecutorEndpoint
from protocol.transport.ipc import ipc_address, remove_private_dirs
from protocol.transport.scheduler_endpoint import PeerStats, Received, SchedulerEndpoint

__all__ = ["ExecutorEndpoint", "PeerStats", "Received", "SchedulerEndpoint", "ipc_address", "remove_private_dirs"]
