"""The carriers of rank 0's feedback tokens (executor.feedback): a CPU group on one host connects its
ranks' sockets and carries what gloo's broadcast carries; a rank that cannot reach rank 0's socket,
or a rank 0 that cannot listen, leaves the whole group on gloo; every carrier says alike, before a later
forward of a step, whether rank 0 cut it there; a GPU group on one host takes the cut flag over the
sockets and its tokens through the process group; a message for another forward, a rank 0 that has
ended and a silent one fail the reader, a reader that has ended fails rank 0; a process that is
not a rank of the group is refused."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import executor.feedback as feedback_module
from executor.feedback import (
    CONNECT_TIMEOUT_S,
    FeedbackError,
    HostFlagFeedback,
    ProcessGroupFeedback,
    SocketFeedback,
    open_feedback,
)
from executor.options import COLLECTIVE_TIMEOUT_S
from executor.steps import StepRunner
from protocol.transport.ipc import private_directory
from tests.executor.executor_standin import KV_HEADS, StandInModel, geometry, make_cache
from tests.model.tp_worker import free_port, join_ranks


def _tokens(step: int) -> torch.Tensor:
    return torch.arange(step % 5 + 1, dtype=torch.long) + 1000 * step


def _rank_body(rank: int, world_size: int, port: int, scenario: str, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        if scenario == "unreached" and rank == 1:
            feedback_module._reach = lambda path: []  # another host's rank, say
        if scenario == "no_listener" and rank == 0:
            feedback_module._listen = lambda world_size, into: (None, None)  # a path too long, say
        if scenario == "gpu_selection":  # open_feedback reads the device's type only
            host_group = dist.new_group(backend="gloo")
            groups = []
            for name in ("broadcast", "all_gather", "all_reduce"):
                collective = getattr(dist, name)

                def recorded(*args, _collective=collective, **kwargs):
                    groups.append(kwargs.get("group"))
                    return _collective(*args, **kwargs)

                setattr(feedback_module.dist, name, recorded)
            carrier = open_feedback(rank, world_size, torch.device("cuda", rank), host_group=host_group)
            assert groups and all(group is host_group for group in groups), groups  # never the default (NCCL's) group
            assert carrier.flags.spin_s == 0  # a GPU group's ranks block for their flags (not measured spinning)
        else:
            carrier = open_feedback(rank, world_size, torch.device("cpu"))
        outcome = type(carrier).__name__
        if scenario == "later":
            assert isinstance(carrier, SocketFeedback)
            pg = ProcessGroupFeedback(rank, torch.device("cpu"))
            decisions = []
            for each in (carrier, pg, HostFlagFeedback(pg, carrier)):
                for step in range(1, 13):
                    for forward in range(1, 4):
                        cut = (step + forward) % 4 == 0
                        # Elsewhere than rank 0 the decision passed is the wrong one: it is not read.
                        rows, tokens = (step + forward) % 5 + 1, _tokens(step + forward) if rank == 0 else None
                        # A CPU runner's rank 0 passes the sample's host array, a GPU's a tensor: both
                        # alike, and what it passed comes back.
                        sent = tokens.numpy() if rank == 0 and step % 2 else tokens
                        got = each.later_forward(step, forward, rows, sent, cut if rank == 0 else not cut)
                        if (got is None) != cut or (got is not None and not torch.equal(torch.as_tensor(got), _tokens(step + forward))):
                            raise AssertionError(f"{type(each).__name__} on rank {rank}: {got} at {step}/{forward}")
                        if got is not None and rank == 0 and got is not sent:
                            raise AssertionError(f"{type(each).__name__} gave rank 0 back {got!r}, not what it passed")
                        decisions.append(got is None)
            outcome = f"{sum(decisions)} cut of {len(decisions)}"
        elif scenario in ("carry", "unreached", "no_listener"):
            if isinstance(carrier, SocketFeedback):
                assert [peer.gettimeout() for peer in carrier.peers] == [COLLECTIVE_TIMEOUT_S] * len(carrier.peers)
                assert carrier.spin_s == feedback_module.FEEDBACK_SPIN_S
            for each in (carrier, ProcessGroupFeedback(rank, torch.device("cpu"))):
                for step in range(1, 30):
                    tokens = _tokens(step) if rank == 0 else torch.empty(step % 5 + 1, dtype=torch.long)
                    # A CPU runner's feed passes host arrays (its view here), a GPU's tensors: both alike.
                    each.start(step, step % 3, tokens.numpy() if step % 2 else tokens)()
                    if not torch.equal(tokens, _tokens(step)):
                        raise AssertionError(f"rank {rank} read {tokens.tolist()} at step {step}")
        elif scenario != "gpu_selection":
            assert isinstance(carrier, SocketFeedback)
            if rank == 0:
                if scenario == "wrong_forward":
                    carrier.start(8, 1, _tokens(7))()
                elif scenario == "ended":
                    carrier.close()
            else:
                if scenario == "silent":
                    assert carrier.peers[0].gettimeout() == COLLECTIVE_TIMEOUT_S
                    carrier.peers[0].settimeout(0.3)
                began = time.monotonic()
                try:
                    carrier.start(8, 2, torch.empty(_tokens(7).shape[0], dtype=torch.long))()
                except FeedbackError as exc:
                    outcome = f"{exc} after {time.monotonic() - began:.1f} s"
                else:
                    outcome = "no error"
            dist.barrier()
        Path(out_dir, f"rank{rank}.txt").write_text(outcome)
        carrier.close()
    finally:
        dist.destroy_process_group()


def _run_group(tmp_path: Path, scenario: str, world_size: int = 2) -> list[str]:
    context = mp.start_processes(
        _rank_body, args=(world_size, free_port(), scenario, str(tmp_path)), nprocs=world_size, join=False,
        start_method="spawn",
    )
    join_ranks(context, 120, f"the ranks of {scenario!r}")
    return [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(world_size)]


def test_a_cpu_group_on_one_host_carries_its_feedback_over_sockets_as_gloo_would(tmp_path) -> None:
    assert _run_group(tmp_path, "carry", world_size=3) == ["SocketFeedback"] * 3


@pytest.mark.parametrize("scenario", ["unreached", "no_listener"])
def test_a_rank_that_cannot_reach_rank_0s_socket_leaves_the_group_on_gloo(tmp_path, scenario: str) -> None:
    assert _run_group(tmp_path, scenario) == ["ProcessGroupFeedback"] * 2


def test_every_carrier_says_alike_whether_rank_0_cut_a_step_before_a_later_forward(tmp_path) -> None:
    assert _run_group(tmp_path, "later") == ["27 cut of 108"] * 2


def test_a_gpu_group_on_one_host_takes_the_cut_flag_over_the_sockets(tmp_path) -> None:
    assert _run_group(tmp_path, "gpu_selection") == ["HostFlagFeedback"] * 2


def test_a_message_for_another_forward_fails_the_reader(tmp_path) -> None:
    _, outcome = _run_group(tmp_path, "wrong_forward")
    assert "rank 0 sent 3 tokens for forward 1 of step 8 where 3 for forward 2 of step 8 were due" in outcome


def test_a_rank_0_that_has_ended_fails_the_reader_at_once(tmp_path) -> None:
    _, outcome = _run_group(tmp_path, "ended")
    assert outcome.startswith("rank 0 closed the feedback channel")
    assert float(outcome.split(" after ")[1].split()[0]) < 30  # not the collective's timeout


def test_a_silent_rank_0_fails_the_reader_after_its_timeout(tmp_path) -> None:
    _, outcome = _run_group(tmp_path, "silent")
    assert outcome.startswith("no feedback from rank 0 for 0.3 s")


def _connecting(path: str) -> subprocess.Popen[str]:
    """A process that connects to `path`, says so, and waits for the connection's end."""
    code = "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); print('in', flush=True); s.recv(1)"
    child = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "in\n"
    return child


def test_rank_0_accepts_the_ranks_of_its_group_and_refuses_any_other_process() -> None:
    directory = private_directory()
    path = os.path.join(directory, "feedback.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    children: list[subprocess.Popen[str]] = []
    peers: list[socket.socket] = []
    try:
        children.append(_connecting(path))  # a stranger, first in the queue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as own:
            own.connect(path)  # rank 0's own process is not a peer either
            children.append(_connecting(path))
            began = time.monotonic()
            peers = feedback_module._accept(listener, [os.getpid(), children[1].pid])
            assert time.monotonic() - began < CONNECT_TIMEOUT_S
        ucred = struct.Struct("iII")
        assert [ucred.unpack(peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, ucred.size))[0] for peer in peers] == [
            children[1].pid
        ]
        assert children[0].wait(timeout=30) == 0  # its connection was closed: its recv returned
    finally:
        for peer in peers:
            peer.close()
        listener.close()
        for child in children:
            child.kill()
            child.wait()
        os.unlink(path)
        os.rmdir(directory)


def test_a_single_rank_has_no_carrier_and_a_gpu_group_without_a_host_group_keeps_its_broadcast() -> None:
    assert open_feedback(0, 1, torch.device("cpu")) is None
    gpu = torch.device("cuda", 1)
    assert open_feedback(1, 2, gpu) == ProcessGroupFeedback(1, gpu)  # no collective on the way


def test_a_step_runner_takes_a_carrier_exactly_when_its_group_has_several_ranks() -> None:
    cache = make_cache(geometry(), KV_HEADS, poison=False)
    model = StandInModel(0, 1)
    with pytest.raises(ValueError, match="needs a feedback carrier"):
        StepRunner(rank=0, world_size=2, model=model, cache=cache, options=None)
    with pytest.raises(ValueError, match="needs a feedback carrier"):
        StepRunner(rank=0, world_size=1, model=model, cache=cache, options=None, feedback=ProcessGroupFeedback(0, torch.device("cpu")))


class _Recorded:
    """A process group's carrier that records what goes through it."""

    def __init__(self) -> None:
        self.started: list[tuple[int, int, list[int]]] = []
        self.device = torch.device("cpu")

    def start(self, step: int, forward: int, tokens: torch.Tensor):
        self.started.append((step, forward, tokens.tolist()))
        return lambda: None


def test_a_gpu_groups_flag_goes_over_the_socket_alone_and_its_tokens_through_the_process_group() -> None:
    left, right = socket.socketpair()
    with left, right:
        group = _Recorded()
        rank0 = HostFlagFeedback(group, SocketFeedback(0, [left]))
        assert torch.equal(rank0.later_forward(5, 1, 2, torch.tensor([7, 8]), cut=False), torch.tensor([7, 8]))
        assert rank0.later_forward(5, 2, 2, torch.tensor([9, 9]), cut=True) is None
        assert group.started == [(5, 1, [7, 8])]  # nothing after a cut
        assert np.frombuffer(right.recv(1024), dtype="<i8").tolist() == [5, 1, 1, 0, 5, 2, 1, 1]

        SocketFeedback(0, [left]).start(6, 1, torch.tensor([0]))()
        SocketFeedback(0, [left]).start(6, 2, torch.tensor([1]))()
        group = _Recorded()
        rank1 = HostFlagFeedback(group, SocketFeedback(1, [right]))
        got = rank1.later_forward(6, 1, 2, None, cut=True)  # its own decision is not read
        assert got is not None and got.shape == (2,)
        assert rank1.later_forward(6, 2, 2, None, cut=False) is None
        assert [(step, forward, len(tokens)) for step, forward, tokens in group.started] == [(6, 1, 2)]


def test_a_message_is_its_step_its_forward_its_length_and_its_tokens() -> None:
    """The layout a reader checks, as rank 0 writes it."""
    left, right = socket.socketpair()
    with left, right:
        SocketFeedback(0, [left]).start(12, 1, torch.tensor([5, 6, 7]))()
        raw = right.recv(1024)
    assert np.frombuffer(raw, dtype="<i8").tolist() == [12, 1, 3, 5, 6, 7]


def test_a_reader_that_has_ended_fails_rank_0() -> None:
    left, right = socket.socketpair()
    right.close()
    with left, pytest.raises(FeedbackError, match="could not reach a rank"):
        SocketFeedback(0, [left]).start(3, 0, torch.tensor([1]))()


def test_a_spinning_reader_takes_what_is_there_gives_up_after_its_time_and_fails_on_a_closed_peer() -> None:
    left, right = socket.socketpair()
    with left, right:
        right.settimeout(COLLECTIVE_TIMEOUT_S)  # as connected: non-blocking underneath
        into = bytearray(8)
        assert feedback_module._spin_read(right, memoryview(into), 0.01) == 0  # nothing came
        left.sendall(b"abc")
        assert feedback_module._spin_read(right, memoryview(into), 0.01) == 3 and bytes(into[:3]) == b"abc"
        left.close()
        with pytest.raises(FeedbackError, match="closed"):
            feedback_module._spin_read(right, memoryview(into), 0.01)


def test_a_rank_spins_for_its_feedback_only_after_a_short_wait(monkeypatch) -> None:
    """After a wait longer than FEEDBACK_SPIN_S (rank 0 sampling a real vocabulary, say) the next
    receive blocks at once: spinning there took a core from rank 0's sampler."""
    spins: list[float] = []
    spin_read = feedback_module._spin_read

    def spying(peer, into, spin_s):
        spins.append(spin_s)
        return spin_read(peer, into, spin_s)

    monkeypatch.setattr(feedback_module, "_spin_read", spying)
    left, right = socket.socketpair()
    with left, right:
        right.settimeout(COLLECTIVE_TIMEOUT_S)
        rank0, rank1 = SocketFeedback(0, [left]), SocketFeedback(1, [right], spin_s=feedback_module.FEEDBACK_SPIN_S)
        for forward, last_wait in enumerate((0.0, 10 * feedback_module.FEEDBACK_SPIN_S, 0.0), start=1):
            rank0.start(3, forward, torch.tensor([forward, 7]))()
            rank1.last_wait_s = last_wait
            into = torch.empty(2, dtype=torch.long)
            rank1.start(3, forward, into)()
            assert into.tolist() == [forward, 7]
            assert rank1.last_wait_s < 1.0
    assert spins == [feedback_module.FEEDBACK_SPIN_S] * 2  # the first and the third receive


class _Carried:
    """A carrier of a group of two that records what rank 0's runner hands its later forwards."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def later_forward(self, step: int, forward: int, rows: int, tokens: object, cut: bool) -> object:
        self.sent.append(tokens)
        return None if cut else tokens


def test_rank_0_of_a_cpu_group_sends_a_later_forward_the_samples_own_array() -> None:
    """Between two forwards of a frame, rank 0 hands its carrier the array the compiled pass wrote
    the sample into (no numpy view made there, change 114), and goes on with the tensor over it."""
    import executor.sampler as sampler

    carrier = _Carried()
    runner = StepRunner(rank=0, world_size=2, model=StandInModel(0, 1), cache=make_cache(geometry(), KV_HEADS, poison=False),
                        options=None, feedback=carrier)  # fmt: skip
    outputs = sampler.HostOutputs.frame(1, 3, 0)[0]
    outputs.tokens[:] = [40, 41, 42]
    runner._samples.tokens, runner._samples.array = outputs.out.token_ids, outputs.tokens
    got = runner._next_tokens(7, 1, 3)
    assert got is outputs.out.token_ids and carrier.sent[-1] is outputs.tokens
    runner._is_cut = lambda step: True
    assert runner._next_tokens(7, 2, 3) is None and carrier.sent[-1] is outputs.tokens
    runner._is_cut = lambda step: False
    runner._samples.array = None  # the passes drew it (no compiled pass): the tensor goes
    assert runner._next_tokens(7, 3, 3) is outputs.out.token_ids and carrier.sent[-1] is outputs.out.token_ids
    # Another rank passes nothing and goes on with what the carrier brings.
    other = StepRunner(rank=1, world_size=2, model=StandInModel(1, 2), cache=make_cache(geometry(), KV_HEADS, poison=False),
                       options=None, feedback=carrier)  # fmt: skip
    carrier.later_forward = lambda step, forward, rows, tokens, cut: carrier.sent.append(tokens) or torch.tensor([5, 6, 7])
    assert other._next_tokens(7, 1, 3).tolist() == [5, 6, 7] and carrier.sent[-1] is None


def test_a_process_group_carrier_puts_a_host_array_on_its_device_as_every_host_copy_goes(monkeypatch) -> None:
    """A host array given to a process group's carrier reaches the group's device through
    host_copy.to_device (on a GPU a copy queued from pinned memory, not one that waits for the
    forward running); on a CPU it is the array's own memory, which a receive fills."""
    import executor.feedback as feedback

    host = np.array([3, 4, 5], dtype=np.int64)
    on_cpu = ProcessGroupFeedback(0, torch.device("cpu"))._tensor(host)
    assert np.shares_memory(on_cpu.numpy(), host)
    tensor = torch.tensor([1, 2])
    assert ProcessGroupFeedback(0, torch.device("cpu"))._tensor(tensor) is tensor
    copied = []
    monkeypatch.setattr(feedback, "to_device", lambda array, device: copied.append((array, device)) or torch.from_numpy(array))
    ProcessGroupFeedback(1, torch.device("cuda", 1))._tensor(host)
    assert len(copied) == 1 and copied[0][0] is host and copied[0][1] == torch.device("cuda", 1)
