"""A rank whose HELLO came early is not taken for a stopped one while the others still load their
weights: the silence the engine judges starts at the WELCOME (under load, ranks finish loading
seconds apart; the first one waits for the WELCOME without a word)."""

from __future__ import annotations

import threading
import time

from protocol.auth import new_key
from protocol.frames import Heartbeat, Shutdown
from protocol.transport import ExecutorEndpoint, SchedulerEndpoint, ipc_address
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.engine.test_handshake import hello
from tp_runtime.engine import Engine, EngineTimeouts

SILENCE_S = 1.0


def test_an_early_hello_is_not_silence_and_a_rank_that_stops_after_welcome_is() -> None:
    key, run_id = new_key(), "late-hello"
    endpoint = SchedulerEndpoint(ipc_address(), key, run_id)
    scheduler = Scheduler(
        SchedulerConfig(num_kv_pages=32, page_size=16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    )
    engine = Engine(
        scheduler=scheduler, endpoint=endpoint, world_size=2, model_name="tiny", max_model_len=256,
        timeouts=EngineTimeouts(handshake_s=20, peer_silence_s=SILENCE_S, heartbeat_s=0.1),
    )  # fmt: skip
    beat_until = {0: time.monotonic() + 60, 1: time.monotonic() + 60}
    told: dict[int, list[object]] = {0: [], 1: []}

    def rank(index: int, hello_after_s: float) -> None:
        peer = ExecutorEndpoint(endpoint.address, key, run_id, index)
        try:
            time.sleep(hello_after_s)
            peer.send(hello(index), 0)
            first_beat = None
            while True:
                frame = peer.recv(100)
                if frame is not None:
                    told[index].append(frame.body)
                    if isinstance(frame.body, Shutdown):
                        return
                    # A loaded host answers its WELCOME a moment later (well within the window).
                    first_beat = first_beat or time.monotonic() + SILENCE_S / 3
                if first_beat is not None and first_beat <= time.monotonic() < beat_until[index]:
                    peer.send(Heartbeat(index), 0)
        finally:
            peer.close()

    threads = [threading.Thread(target=rank, args=(0, 0.0)), threading.Thread(target=rank, args=(1, 3 * SILENCE_S))]
    for t in threads:
        t.start()
    engine.start()
    try:
        engine.wait_ready(30)
        time.sleep(3 * SILENCE_S)  # both heartbeat after the WELCOME: nobody is silent
        assert engine.health().ok, engine.health()
        assert engine.stats().peer_longest_silence_s < SILENCE_S
        beat_until[1] = 0.0  # rank 1 stops answering
        deadline = time.monotonic() + 5 * SILENCE_S
        while engine.health().ok and time.monotonic() < deadline:
            time.sleep(0.05)
        health = engine.health()
        assert not health.ok and "rank 1" in health.reason and "stopped answering" in health.reason, health
        engine.shutdown("test over")  # joins the loop: its last snapshot is published
        assert engine.stats().peer_longest_silence_s > SILENCE_S  # the silence that failed it, on /metrics
    finally:
        engine.shutdown("test over")
        for t in threads:
            t.join(timeout=30)
        endpoint.close()
