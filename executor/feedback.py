"""How the tokens rank 0 samples reach the other ranks of its group before their next forward.

Every rank of a group reads a step's feedback from the same PREPARE, so every rank starts the same
message at the same point of the same step (executor.steps), the way a collective is entered. Two
carriers take it:

- `GlooFeedback`: a broadcast in the group's own process group. On a GPU (NCCL) the tokens stay on
  the device; across hosts it is the group's one channel.
- `SocketFeedback`: a Unix socket from rank 0 to each other rank, for a CPU group on one host. On a
  2-core VM gloo's broadcast took 150-200 us one way and ~100 us to post on each side (its worker
  and loop threads wake one after another, on whichever core is free), where a socket's blocked
  reader takes one wake-up (docs/control_plane.md, fifteenth sitting). The other ranks start their
  forward that much sooner; on the CPU their forward waits for nothing else of rank 0's.

`open_feedback` picks one, collectively: every rank of a CPU group must reach rank 0's socket and
rank 0 must recognise each of them, or the whole group keeps gloo. A peer is recognised by its
process id, which the kernel reports for a Unix socket (SO_PEERCRED) and which every rank
announced through the process group beforehand; the socket lies in a directory only this user can
enter and is unlinked once the group is connected. A message carries its step and its length, so a
rank that would read another step's tokens fails instead; a closed socket (its peer ended) fails at
once, a silent one after the process group's own timeout, as gloo would.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from protocol.transport.ipc import private_directory

logger = logging.getLogger("tp_runtime.executor")

# The process group's timeout (tp_runtime.worker_process): a silent rank 0 fails a socket's reader
# when it would fail gloo's.
COLLECTIVE_TIMEOUT_S = 60.0
# How long rank 0 waits for every other rank's connection once each has said it connected.
CONNECT_TIMEOUT_S = 10.0
_PATH_BYTES = 256
_HEADER = np.dtype([("step", "<i8"), ("count", "<i8")])


class FeedbackError(RuntimeError):
    """The feedback could not be carried: its peer ended, stayed silent, or sent another step's."""


class Feedback(Protocol):
    def start(self, step: int, tokens: torch.Tensor) -> Callable[[], None]:
        """Rank 0: sends `tokens` (int64, contiguous) to every other rank; elsewhere: receives them
        into `tokens`, of the same length. Returns the wait: once it returns, `tokens` holds rank 0's
        on every rank. Raises (at once or from the wait) what leaves the group unusable."""
        ...

    def close(self) -> None: ...


class GlooFeedback:
    """A broadcast in the default process group (gloo's on a CPU, NCCL's on a GPU)."""

    def start(self, step: int, tokens: torch.Tensor) -> Callable[[], None]:
        return dist.broadcast(tokens, src=0, async_op=True).wait

    def close(self) -> None:
        pass


@dataclass
class SocketFeedback:
    """Rank 0's connection to each other rank (in rank order), or another rank's to rank 0."""

    rank: int
    peers: list[socket.socket]

    def start(self, step: int, tokens: torch.Tensor) -> Callable[[], None]:
        values = tokens.numpy()
        if self.rank == 0:
            header = np.array([(step, values.shape[0])], dtype=_HEADER)
            for peer in self.peers:
                _send(peer, header, values)
            return _sent
        return lambda: self._receive(step, values)

    def _receive(self, step: int, into: np.ndarray) -> None:
        message = np.empty(_HEADER.itemsize + into.nbytes, dtype=np.uint8)
        _receive_exactly(self.peers[0], memoryview(message))
        header = message[: _HEADER.itemsize].view(_HEADER)[0]
        if (int(header["step"]), int(header["count"])) != (step, into.shape[0]):
            raise FeedbackError(
                f"rank 0 sent step {int(header['step'])}'s {int(header['count'])} feedback tokens where step "
                f"{step}'s {into.shape[0]} were due: the ranks disagree on the steps they run"
            )
        into[:] = message[_HEADER.itemsize :].view(np.int64)

    def close(self) -> None:
        for peer in self.peers:
            peer.close()


def _sent() -> None:
    pass


def _send(peer: socket.socket, header: np.ndarray, values: np.ndarray) -> None:
    try:
        sent = peer.sendmsg([header, values], [], socket.MSG_NOSIGNAL)
        if sent < header.nbytes + values.nbytes:  # the socket's buffer full: a peer far behind
            peer.sendall(memoryview(header.tobytes() + values.tobytes())[sent:])
    except OSError as exc:
        raise FeedbackError(f"the feedback could not reach a rank: {exc!r} (it has ended)") from exc


def _receive_exactly(peer: socket.socket, into: memoryview) -> None:
    got = 0
    while got < len(into):
        try:
            n = peer.recv_into(into[got:], len(into) - got, socket.MSG_WAITALL)
        except TimeoutError as exc:
            raise FeedbackError(f"no feedback from rank 0 for {peer.gettimeout():g} s") from exc
        except OSError as exc:
            raise FeedbackError(f"the feedback from rank 0 could not be read: {exc!r}") from exc
        if n == 0:
            raise FeedbackError("rank 0 closed the feedback channel: it has ended")
        got += n


def open_feedback(rank: int, world_size: int, device: torch.device) -> Feedback | None:
    """The group's feedback carrier (None for a single rank). Collective: every rank of the group
    calls it at the same point of its start."""
    if world_size == 1:
        return None
    if device.type != "cpu" or not hasattr(socket, "SO_PEERCRED"):
        return GlooFeedback()
    connected = _connect_sockets(rank, world_size)
    if connected is None:
        logger.info("[rank %d] the feedback goes through gloo: not every rank reached rank 0's socket", rank)
        return GlooFeedback()
    return connected


def _connect_sockets(rank: int, world_size: int) -> SocketFeedback | None:
    directory = private_directory() if rank == 0 else None
    listener: socket.socket | None = None
    peers: list[socket.socket] = []
    try:
        path = torch.zeros(_PATH_BYTES, dtype=torch.uint8)
        if directory is not None:
            listener = _listen(os.path.join(directory, "feedback.sock"), world_size, path)
        dist.broadcast(path, src=0)
        pids = [torch.zeros(1, dtype=torch.long) for _ in range(world_size)]
        dist.all_gather(pids, torch.tensor([os.getpid()]))
        reached = torch.tensor([1 if listener is not None else 0])
        if rank != 0:
            to_rank0 = _reach(bytes(path.numpy()).rstrip(b"\0").decode())
            peers = [to_rank0] if to_rank0 is not None else []
            reached[0] = len(peers)
        dist.all_reduce(reached, op=dist.ReduceOp.MIN)
        accepted = torch.tensor([0])
        if rank == 0 and int(reached[0]):
            peers = _accept(listener, [int(pid) for pid in pids])
            accepted[0] = int(len(peers) == world_size - 1)
        dist.broadcast(accepted, src=0)
        if not int(accepted[0]):
            for peer in peers:
                peer.close()
            return None
        for peer in peers:
            peer.settimeout(COLLECTIVE_TIMEOUT_S)
        return SocketFeedback(rank, peers)
    finally:
        if listener is not None:
            listener.close()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def _listen(path: str, world_size: int, into: torch.Tensor) -> socket.socket | None:
    encoded = path.encode()
    if len(encoded) >= _PATH_BYTES:
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(world_size)
    except OSError as exc:
        logger.warning("the feedback socket could not be bound at %s: %r", path, exc)
        listener.close()
        return None
    into[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    return listener


def _reach(path: str) -> socket.socket | None:
    if not path:
        return None
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.settimeout(CONNECT_TIMEOUT_S)
    try:
        peer.connect(path)
    except OSError:  # another host, or another mount namespace: gloo carries it
        peer.close()
        return None
    return peer


def _accept(listener: socket.socket | None, pids: list[int]) -> list[socket.socket]:
    """The other ranks' connections in rank order, each recognised by its process id; a connection
    from any other process is closed. Fewer than all of them when the time runs out."""
    assert listener is not None
    by_rank: dict[int, socket.socket] = {}
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while len(by_rank) < len(pids) - 1:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        listener.settimeout(left)
        try:
            peer, _ = listener.accept()
        except TimeoutError:
            break
        pid, uid, _gid = struct.unpack("3i", peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        rank = pids.index(pid) if pid in pids else 0
        if rank == 0 or uid != os.getuid() or rank in by_rank:
            logger.warning("refused a connection to the feedback socket from process %d (uid %d): not a rank of this group", pid, uid)
            peer.close()
            continue
        by_rank[rank] = peer
    return [by_rank[r] for r in sorted(by_rank)]
