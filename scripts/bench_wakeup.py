"""What one message between two processes costs on this machine, by where the two run.

A Unix socket with a blocked reader wakes one thread; a ZeroMQ message passes through the sender's
and the receiver's I/O threads as well. Where the reader's core is idle (halted), waking it is an
inter-processor interrupt, which on a virtual machine without guest halt-polling costs tens of
microseconds: that, not the transport's code, is what sets the floor of a hop between two ranks
whose cores both run (docs/control_plane.md, fifteenth sitting).

Each case sends --messages messages --gap-ms apart (long enough for the reader's core to go idle,
as between two forwards) and reports the median and p90 one-way time, from the sender's clock
before the send to the reader's after its receive (perf_counter: one clock for every process):
unpinned (the kernel places both), both processes on one core, each on a core of its own.

And what a halt costs the thread that comes back from it (`after_idle`): a small piece of work (a
sixteen-row sum, as a sampler's first touch of its logits) timed right after the thread slept
--gap-ms, against right after it spun for as long, in alternating blocks. Where an idle core halts and the
host runs something else on it meanwhile, the work after the sleep finds the caches and TLB cold:
every piece of a step's gap that follows a sleeping forward pays that (docs/control_plane.md,
twenty-third sitting). With the machine's idle driver and its halt-polling window, as /sys says.

    python scripts/bench_wakeup.py            # prints one JSON object
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np
import zmq


# Every wait has a bound: a reader that died leaves the benchmark with an error, not a hang.
WAIT_S = 30.0


def _pin(core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})


def _socket_reader(path: str, core: int | None, count: int, out: Connection) -> None:
    _pin(core)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
        peer.settimeout(WAIT_S)
        peer.connect(path)
        arrived = []
        for _ in range(count):
            peer.recv(8)
            arrived.append(time.perf_counter())
            peer.sendall(b"k")
    out.send(arrived)


def _zmq_reader(address: str, core: int | None, count: int, out: Connection) -> None:
    _pin(core)
    context = zmq.Context()
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
    try:
        peer.connect(address)
        peer.send(b"hello")
        arrived = []
        for _ in range(count):
            peer.recv()
            arrived.append(time.perf_counter())
            peer.send(b"k")
        out.send(arrived)
    finally:
        peer.close(0)
        context.term()


def _one_way(reader: Callable[..., None], serve: Callable[[Callable[[], None]], list[float]], where: str,
             cores: tuple[int | None, int | None], count: int) -> list[float]:
    """`serve` binds `where` before the reader starts and sends it `count` messages; the reader
    reports when each arrived."""
    spawn = mp.get_context("spawn")
    receive, send = spawn.Pipe(duplex=False)
    started = spawn.Process(target=reader, args=(where, cores[1], count, send))
    own = os.sched_getaffinity(0)
    try:
        sent = serve(lambda: (started.start(), send.close(), _pin(cores[0])))
        if not receive.poll(WAIT_S):
            raise TimeoutError(f"the reader of {where} reported nothing")
        arrived = receive.recv()
    finally:
        if started.is_alive():
            started.kill()
        if started.pid is not None:
            started.join()
        os.sched_setaffinity(0, own)
    return [(a - s) * 1e6 for s, a in zip(sent, arrived)]


def _socket_case(directory: str, cores: tuple[int | None, int | None], count: int, gap_s: float) -> list[float]:
    path = os.path.join(directory, f"wake-{cores}.sock")

    def serve(begin: Callable[[], None]) -> list[float]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen(1)
            listener.settimeout(WAIT_S)
            begin()
            peer, _ = listener.accept()
            peer.settimeout(WAIT_S)
            with peer:
                sent = []
                for _ in range(count):
                    time.sleep(gap_s)
                    sent.append(time.perf_counter())
                    peer.sendall(b"12345678")
                    peer.recv(1)
                return sent

    return _one_way(_socket_reader, serve, path, cores, count)


def _zmq_case(directory: str, cores: tuple[int | None, int | None], count: int, gap_s: float) -> list[float]:
    address = f"ipc://{directory}/wake-zmq-{cores[0]}-{cores[1]}.sock"

    def serve(begin: Callable[[], None]) -> list[float]:
        context = zmq.Context()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
        try:
            router.bind(address)
            begin()
            identity, _ = router.recv_multipart()
            sent = []
            for _ in range(count):
                time.sleep(gap_s)
                sent.append(time.perf_counter())
                router.send_multipart([identity, b"12345678"])
                router.recv_multipart()
            return sent
        finally:
            router.close(0)
            context.term()

    return _one_way(_zmq_reader, serve, address, cores, count)


# The work timed after an idle: a sampler's first touch of sixteen rows of logits, about.
_AFTER_IDLE_ROWS = np.ones((16, 256), dtype=np.float32)


def after_idle(count: int, gap_s: float, blocks: int = 4) -> dict[str, dict[str, float | int]]:
    """Microseconds (median, p90) of a sum over _AFTER_IDLE_ROWS right after a sleep of gap_s and
    right after a spin of gap_s, and how many of each were timed (`turns`: blocks x max(2, count //
    blocks)), in alternating blocks, each block's first left out.
    Blocks, not single turns: a spin does not touch what the sum touches, so a spin after a sleep
    finds the sum's code and data as cold as the sleep left them."""
    times: dict[str, list[float]] = {"after_sleep_us": [], "after_spin_us": []}
    per_block = max(2, count // blocks)
    for block in range(2 * blocks):
        slept = block % 2 == 0
        for turn in range(per_block + 1):
            if slept:
                time.sleep(gap_s)
            else:
                until = time.perf_counter() + gap_s
                while time.perf_counter() < until:
                    pass
            began = time.perf_counter()
            _AFTER_IDLE_ROWS.sum()
            if turn:
                times["after_sleep_us" if slept else "after_spin_us"].append((time.perf_counter() - began) * 1e6)
    return {
        name: {"median": round(float(np.median(v)), 1), "p90": round(float(np.percentile(v, 90)), 1), "turns": len(v)}
        for name, v in times.items()
    }


def idle_driver(sys_root: str = "/sys") -> dict[str, str | None]:
    """The kernel's idle driver and governor, and the guest halt-polling window where it has one
    (None where this machine does not say)."""

    def read(path: str) -> str | None:
        try:
            with open(f"{sys_root}/{path}") as f:
                return f.read().strip()
        except OSError:
            return None

    cpuidle = "devices/system/cpu/cpuidle"
    return {
        "driver": read(f"{cpuidle}/current_driver"),
        "governor": read(f"{cpuidle}/current_governor_ro") or read(f"{cpuidle}/current_governor"),
        "guest_halt_poll_ns": read("module/haltpoll/parameters/guest_halt_poll_ns"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=3.0)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    placements: dict[str, tuple[int | None, int | None]] = {"unpinned": (None, None), "one_core": (cpus[0], cpus[0])}
    if len(cpus) > 1:
        placements["two_cores"] = (cpus[0], cpus[1])
    report: dict[str, object] = {"cpus": len(cpus), "messages": args.messages, "gap_ms": args.gap_ms}
    with tempfile.TemporaryDirectory() as directory:
        for transport, case in (("unix_socket", _socket_case), ("zeromq_ipc", _zmq_case)):
            for name, cores in placements.items():
                times = np.asarray(case(directory, cores, args.messages, args.gap_ms / 1e3))
                report[f"{transport}/{name}_us"] = {
                    "median": round(float(np.median(times)), 1), "p90": round(float(np.percentile(times, 90)), 1)
                }
    report["after_idle"] = after_idle(args.messages, args.gap_ms / 1e3)
    report["idle"] = idle_driver()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
