"""How the tokens rank 0 samples reach the other ranks of its group before their next forward.

Every rank of a group reads a step's feedback from the same PREPARE, so every rank starts the same
message at the same point of the same step (executor.steps), the way a collective is entered. Before
each later forward of a step of several, the message also says whether rank 0 cut the step there.
Three carriers take it:

- `ProcessGroupFeedback`: a broadcast in the group's own process group, the cut flag after the
  tokens. Across hosts it is the group's one channel; there the other ranks of a GPU group read
  the flag off the device, which waits for the forward before it.
- `SocketFeedback`: a Unix socket from rank 0 to each other rank, for a CPU group on one host. On a
  2-core VM gloo's broadcast took 150-200 us one way and ~100 us to post on each side (its worker
  and loop threads wake one after another, on whichever core is free), where a socket's blocked
  reader takes one wake-up (docs/control_plane.md, fifteenth sitting), and a reader that spins
  for it none (_spin_read: where the last wait was short). The other ranks start their forward
  that much sooner; on the CPU their forward waits for nothing else of rank 0's.
- `HostFlagFeedback`, for a GPU group on one host: the tokens through NCCL (they stay on the
  device), the cut flag through the same sockets, decided on rank 0's host. The other ranks then
  know whether a later forward runs as soon as rank 0's host does, and queue it behind the tokens'
  broadcast without waiting for the device (read off the device, the flag held every rank's GPU
  idle for that read and a launch before each later forward of a frame).

`open_feedback` picks one, collectively: every rank must reach rank 0's socket and rank 0 must
recognise each of them, or the whole group keeps its process group's broadcast. A peer is
recognised by its process id, which the kernel reports for a Unix socket (SO_PEERCRED) and which
every rank announced through the process group beforehand; the socket lies in a directory only
this user can enter and is unlinked once the group is connected. A message names the step and the
forward of it whose input its tokens are, and their count, so a rank that would read another
forward's tokens fails instead; a closed socket (its peer ended) fails at once, a silent one after
COLLECTIVE_TIMEOUT_S, the timeout tp_runtime's launch gives the process group, as a collective
would there.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from executor.host_copy import to_device
from executor.options import COLLECTIVE_TIMEOUT_S
from protocol.errors import TPRuntimeError
from protocol.transport.ipc import private_directory

logger = logging.getLogger("tp_runtime.executor")

# How long a rank may take to connect to rank 0's socket, and rank 0 to accept every rank once each
# has said it connected.
CONNECT_TIMEOUT_S = 10.0
_PATH_BYTES = 256
_HEADER_WORDS = 3  # int64: the step, the forward of it the tokens go into, their count
# How long a rank reads for its feedback before it blocks (_spin_read), where its last wait was
# shorter than that: about rank 0's whole gap between two forwards of a small batch (~0.2-0.3 ms
# at 16 rows of bench_step's vocabulary). Where rank 0 samples longer (a real vocabulary on a
# CPU: ~1 ms, on both cores), a spinning rank took a core from rank 0's sampler: served at TP=2
# on two cores, a 1 ms spin made the time per token 8% longer. Those ranks block as before.
FEEDBACK_SPIN_S = 0.0005
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


class FeedbackError(TPRuntimeError, RuntimeError):
    """The feedback could not be carried: its peer ended, stayed silent, or sent another forward's."""


class Feedback(Protocol):
    def start(self, step: int, forward: int, tokens: torch.Tensor | np.ndarray) -> Callable[[], None]:
        """Rank 0: sends `tokens` (int64, contiguous), the input of forward `forward` of `step`, to
        every other rank; elsewhere: receives them into `tokens`, of the same length. Returns the
        wait: once it returns, `tokens` holds rank 0's on every rank. Raises (at once or from the
        wait) what leaves the group unusable. A CPU group's runner passes a host array: a torch
        view of it and a numpy view back cost ~20-50 us cold on each rank between two forwards
        (docs/control_plane.md, change 112)."""
        ...

    def later_forward(
        self, step: int, forward: int, rows: int, tokens: torch.Tensor | np.ndarray | None, cut: bool
    ) -> torch.Tensor | np.ndarray | None:
        """Before forward `forward` (1 or more) of `step`: every rank's copy of the `rows` tokens
        rank 0 sampled in the forward before, or None on every rank where rank 0 cut the step. Rank
        0 passes its tokens and its decision, and gets back what it passed (a CPU group's runner
        passes the sample's host array, as to start()); elsewhere `tokens` is None, `cut` is not
        read, and the tokens come back as a tensor."""
        ...

    def close(self) -> None: ...


@dataclass
class ProcessGroupFeedback:
    """A broadcast in the default process group: NCCL's on a GPU, gloo's on a CPU."""

    rank: int
    device: torch.device  # the tokens'

    def start(self, step: int, forward: int, tokens: torch.Tensor | np.ndarray) -> Callable[[], None]:
        return dist.broadcast(self._tensor(tokens), src=0, async_op=True).wait

    def _tensor(self, tokens: torch.Tensor | np.ndarray) -> torch.Tensor:
        """A host array's tensor on the group's device: on a CPU its memory, which a receive fills;
        on a GPU a copy queued from pinned memory (host_copy says why)."""
        return to_device(tokens, self.device) if isinstance(tokens, np.ndarray) else tokens

    def later_forward(
        self, step: int, forward: int, rows: int, tokens: torch.Tensor | np.ndarray | None, cut: bool
    ) -> torch.Tensor | np.ndarray | None:
        """One message: the tokens, then rank 0's decision whether the step goes on."""
        if tokens is not None:  # rank 0
            # Filled on the device: a copy from the host would wait for the forward running.
            flag = torch.full((1,), int(cut), dtype=torch.long, device=self.device)
            self.start(step, forward, torch.cat((self._tensor(tokens), flag)))()
            return None if cut else tokens
        message = torch.empty(rows + 1, dtype=torch.long, device=self.device)
        self.start(step, forward, message)()
        return None if int(message[-1]) else message[:-1]

    def close(self) -> None:
        pass


@dataclass
class SocketFeedback:
    """Rank 0's connection to each other rank (in rank order), or another rank's to rank 0."""

    rank: int
    peers: list[socket.socket]
    # How long a rank reads for its feedback before it blocks, where its last wait was shorter:
    # FEEDBACK_SPIN_S in a CPU group; 0 (never) where the sockets carry a GPU group's cut flags,
    # whose ranks it has not been measured on.
    spin_s: float = 0.0
    # How long the last receive waited for its message (rank 0 takes none).
    last_wait_s: float = field(default=0.0, init=False, repr=False, compare=False)

    def start(self, step: int, forward: int, tokens: torch.Tensor | np.ndarray) -> Callable[[], None]:
        values = _array(tokens)
        if self.rank == 0:
            self._send(step, forward, values)
            return _sent
        return partial(self._receive, (step, forward, values.shape[0]), values)

    def _send(self, step: int, forward: int, values: np.ndarray) -> None:
        header = np.array([step, forward, values.shape[0]], dtype=np.int64)
        for peer in self.peers:
            _send(peer, header, values)

    def _receive(self, due: tuple[int, int, int], into: np.ndarray) -> None:
        header = np.empty(_HEADER_WORDS, dtype=np.int64)
        waiting = time.perf_counter()
        spin = self.spin_s if self.last_wait_s < self.spin_s else 0.0
        _receive_exactly(self.peers[0], memoryview(header).cast("B"), spin)
        self.last_wait_s = time.perf_counter() - waiting
        got = tuple(header.tolist())
        if got != due:
            raise FeedbackError(
                f"rank 0 sent {got[2]} tokens for forward {got[1]} of step {got[0]} where {due[2]} for forward "
                f"{due[1]} of step {due[0]} were due: the ranks disagree on the forwards they run"
            )
        _receive_exactly(self.peers[0], memoryview(into).cast("B"))

    def later_forward(
        self, step: int, forward: int, rows: int, tokens: torch.Tensor | np.ndarray | None, cut: bool
    ) -> torch.Tensor | np.ndarray | None:
        # ProcessGroupFeedback's message, made and read in numpy: its torch calls (the flag's fill,
        # the cat, the flag's read and the slice) cost ~60 us of rank 0's gap between two forwards
        # of a frame, cold (bench_step --num-scheduler-steps 16 at 2 ranks).
        message = np.empty(rows + 1, dtype=np.int64)
        if tokens is not None:  # rank 0
            message[:rows] = _array(tokens)
            message[rows] = cut
            self._send(step, forward, message)
            return None if cut else tokens
        self._receive((step, forward, rows + 1), message)
        return None if message[rows] else torch.from_numpy(message[:rows])

    def close(self) -> None:
        for peer in self.peers:
            peer.close()


@dataclass
class HostFlagFeedback:
    """A GPU group on one host: the tokens through the process group, the cut flag through the
    host's sockets (the module says why)."""

    tokens: ProcessGroupFeedback
    flags: SocketFeedback

    def start(self, step: int, forward: int, tokens: torch.Tensor | np.ndarray) -> Callable[[], None]:
        return self.tokens.start(step, forward, tokens)

    def later_forward(
        self, step: int, forward: int, rows: int, tokens: torch.Tensor | np.ndarray | None, cut: bool
    ) -> torch.Tensor | np.ndarray | None:
        flag = torch.tensor([int(cut)])
        self.flags.start(step, forward, flag)()
        if int(flag[0]):  # every rank skips the broadcast alike
            return None
        if tokens is None:
            tokens = torch.empty(rows, dtype=torch.long, device=self.tokens.device)
        self.tokens.start(step, forward, tokens)()
        return tokens

    def close(self) -> None:
        self.flags.close()


def _sent() -> None:
    pass


def _send(peer: socket.socket, header: np.ndarray, values: np.ndarray) -> None:
    try:
        sent = peer.sendmsg([header, values], [], socket.MSG_NOSIGNAL)
        if sent < header.nbytes + values.nbytes:  # the socket's buffer full: a peer far behind
            peer.sendall(memoryview(header.tobytes() + values.tobytes())[sent:])
    except TimeoutError as exc:
        raise FeedbackError(f"a rank read no feedback for {peer.gettimeout():g} s") from exc
    except OSError as exc:
        raise FeedbackError(f"the feedback could not reach a rank: {exc!r} (it has ended)") from exc


def _array(tokens: torch.Tensor | np.ndarray) -> np.ndarray:
    """A host tensor's numpy view, or the host array itself."""
    return tokens if isinstance(tokens, np.ndarray) else tokens.numpy()


def _receive_exactly(peer: socket.socket, into: memoryview, spin_s: float = 0.0) -> None:
    # A loop, not MSG_WAITALL: a socket with a timeout is non-blocking underneath, and a receive
    # returns what has arrived.
    got = _spin_read(peer, into, spin_s) if spin_s and peer.gettimeout() else 0
    while got < len(into):
        try:
            n = peer.recv_into(into[got:])
        except TimeoutError as exc:
            raise FeedbackError(f"no feedback from rank 0 for {peer.gettimeout():g} s") from exc
        except OSError as exc:
            raise FeedbackError(f"the feedback from rank 0 could not be read: {exc!r}") from exc
        if n == 0:
            raise FeedbackError("rank 0 closed the feedback channel: it has ended")
        got += n


def _spin_read(peer: socket.socket, into: memoryview, spin_s: float) -> int:
    """What arrives within spin_s, read as soon as it comes, the thread kept running: a rank
    blocked for its feedback is woken through the hypervisor once its core has halted (60-79 us
    on the 2-core VM, more where the wake-up lands behind another thread: docs/control_plane.md),
    a spinning one reads it at once. Yields its CPU between tries, so that another thread there
    runs first. 0 when nothing came."""
    fd, deadline = peer.fileno(), time.perf_counter() + spin_s
    while True:
        try:
            n = os.readv(fd, [into])  # the fd is non-blocking: the socket has a timeout (the caller checks)
        except BlockingIOError:
            if time.perf_counter() >= deadline:
                return 0
            os.sched_yield()
            continue
        except OSError as exc:
            raise FeedbackError(f"the feedback from rank 0 could not be read: {exc!r}") from exc
        if n == 0:
            raise FeedbackError("rank 0 closed the feedback channel: it has ended")
        return n


def open_feedback(
    rank: int, world_size: int, device: torch.device, host_group: dist.ProcessGroup | None = None
) -> Feedback | None:
    """The group's feedback carrier (None for a single rank). Collective: every rank of the group
    calls it at the same point of its start, and every rank enters each of its collectives whatever
    failed locally (a local failure is a vote for the process group's broadcast). The sockets are
    connected through a gloo group: on a CPU the default one, on a GPU `host_group` (a GPU group
    without one keeps NCCL's broadcast alone)."""
    if world_size == 1:
        return None
    on_cpu = device.type == "cpu"
    if not on_cpu and host_group is None:
        return ProcessGroupFeedback(rank, device)
    connected = _connect_sockets(rank, world_size, None if on_cpu else host_group)
    if connected is None:
        logger.info("[rank %d] the feedback goes through the process group: not every rank could be connected to rank 0's socket", rank)
        return ProcessGroupFeedback(rank, device)
    if on_cpu:
        connected.spin_s = FEEDBACK_SPIN_S
        return connected
    return HostFlagFeedback(ProcessGroupFeedback(rank, device), connected)


def _connect_sockets(rank: int, world_size: int, group: dist.ProcessGroup | None) -> SocketFeedback | None:
    directory: str | None = None
    listener: socket.socket | None = None
    peers: list[socket.socket] = []
    try:
        path = torch.zeros(_PATH_BYTES, dtype=torch.uint8)
        if rank == 0:
            directory, listener = _listen(world_size, path)
        dist.broadcast(path, group=group, group_src=0)
        pids = [torch.zeros(1, dtype=torch.long) for _ in range(world_size)]
        dist.all_gather(pids, torch.tensor([os.getpid()]), group=group)
        reached = torch.tensor([int(listener is not None)])
        if rank != 0:
            peers = _reach(bytes(path.numpy()).rstrip(b"\0").decode())
            reached[0] = len(peers)
        dist.all_reduce(reached, op=dist.ReduceOp.MIN, group=group)
        accepted = torch.tensor([0])
        if listener is not None and int(reached[0]):
            peers = _accept(listener, [int(pid) for pid in pids])
            accepted[0] = int(len(peers) == world_size - 1)
        dist.broadcast(accepted, group=group, group_src=0)
        if not int(accepted[0]):
            return None
        for peer in peers:
            peer.settimeout(COLLECTIVE_TIMEOUT_S)
        connected, peers = SocketFeedback(rank, peers), []
        return connected
    finally:
        for peer in peers:  # a group that keeps its process group's broadcast closes them
            peer.close()
        if listener is not None:
            listener.close()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def _listen(world_size: int, into: torch.Tensor) -> tuple[str | None, socket.socket | None]:
    """Rank 0's private directory (to remove) and listening socket in it, its path written into
    `into`; no socket where it cannot be made, which the other ranks read as an empty path."""
    if not hasattr(socket, "SO_PEERCRED"):  # no way to recognise a peer
        return None, None
    try:
        directory = private_directory()
    except OSError as exc:
        logger.warning("no directory for the feedback socket: %r", exc)
        return None, None
    path = os.path.join(directory, "feedback.sock").encode()
    listener = None
    try:
        if len(path) >= _PATH_BYTES:
            raise OSError(f"{len(path)} bytes of path")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(world_size)
    except OSError as exc:
        logger.warning("the feedback socket could not be bound at %s: %r", path.decode(), exc)
        if listener is not None:
            listener.close()
        return directory, None
    into[: len(path)] = torch.frombuffer(bytearray(path), dtype=torch.uint8)
    return directory, listener


def _reach(path: str) -> list[socket.socket]:
    """Another rank's connection to rank 0's socket, or none."""
    if not path or not hasattr(socket, "SO_PEERCRED"):
        return []
    try:
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:
        return []
    peer.settimeout(CONNECT_TIMEOUT_S)
    try:
        peer.connect(path)
    except OSError:  # another host, or another mount namespace: the process group carries it
        peer.close()
        return []
    return [peer]


def _accept(listener: socket.socket, pids: list[int]) -> list[socket.socket]:
    """The other ranks' connections in rank order, each recognised by its process id; a connection
    from any other process is closed. Fewer than all of them when the time runs out or accepting
    fails (ranks in another PID namespace are never recognised: the group keeps its process group's
    broadcast after CONNECT_TIMEOUT_S)."""
    by_rank: dict[int, socket.socket] = {}
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    try:
        while len(by_rank) < len(pids) - 1 and (left := deadline - time.monotonic()) > 0:
            listener.settimeout(left)
            peer, _ = listener.accept()
            try:
                pid, uid, _gid = _UCRED.unpack(peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            except OSError:
                peer.close()
                raise
            rank = pids.index(pid, 1) if pid in pids[1:] else None
            if rank is None or uid != os.getuid() or rank in by_rank:
                logger.warning("refused a connection to the feedback socket from process %d (uid %d): not a rank of this group", pid, uid)
                peer.close()
                continue
            by_rank[rank] = peer
    except OSError as exc:  # TimeoutError among them
        logger.warning("the feedback socket accepted %d of %d ranks: %r", len(by_rank), len(pids) - 1, exc)
    return [by_rank[r] for r in sorted(by_rank)]
