"""Engine.submit turns a prompt into an int32 array on the caller's thread and refuses, with the
scheduler's admission error, ids that numpy would silently truncate or wrap."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.auth import new_key
from protocol.transport import SchedulerEndpoint, ipc_address
from scheduler.request import SamplingParams
from scheduler.scheduler import AdmissionError, Scheduler, SchedulerConfig
from tp_runtime.engine import Engine


@pytest.fixture
def engine():
    endpoint = SchedulerEndpoint(ipc_address(), new_key(), "run-under-test")
    scheduler = Scheduler(
        SchedulerConfig(num_kv_pages=32, page_size=16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    )
    try:
        yield Engine(scheduler=scheduler, endpoint=endpoint, world_size=1, model_name="tiny", max_model_len=256)
    finally:
        endpoint.close()


def test_submit_hands_the_engine_thread_an_int32_array(engine):
    stream = engine.submit([5, 2**31 - 1, 0], SamplingParams(max_tokens=4))
    command = engine._inbox.get_nowait()
    assert command.stream is stream and stream.prompt_len == 3
    assert command.prompt_token_ids.dtype == np.int32
    assert command.prompt_token_ids.tolist() == [5, 2**31 - 1, 0]


@pytest.mark.parametrize("bad", [[3, 1.5], [3, "7"], [3, 2**31], [3, 2**70], [[3, 4]]])
def test_submit_refuses_ids_that_are_not_32_bit_integers(engine, bad):
    with pytest.raises(AdmissionError, match="invalid prompt"):
        engine.submit(bad, SamplingParams(max_tokens=4))
    assert engine._inbox.empty()
