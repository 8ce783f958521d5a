"""Frames and conversations in known states, for the conversation's tests."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np

from protocol.conversation import ExecutorConversation, SchedulerConversation
from protocol.frames import LAYOUT_VERSION, PROTOCOL_VERSION, SUPPORTED_VERSIONS, Body, Frame, Hello, Result, Welcome
from tests.protocol.wire_samples import GEOMETRY, RUN_ID, valid_prepare

V = PROTOCOL_VERSION
_seq = itertools.count(1)


def frame(body: Body, step: int = 0, *, version: int = V, layout: int = LAYOUT_VERSION, run_id: str = RUN_ID) -> Frame:
    return Frame(version, layout, run_id, step, next(_seq), body)


def hello(rank: int, world: int = 2, **changes: object) -> Hello:
    base = Hello(rank, world, SUPPORTED_VERSIONS, LAYOUT_VERSION, "weights-1", GEOMETRY, "options-1", f"host-{rank}")
    return replace(base, **changes)


def result(step_seq_ids: tuple[int, ...] = (1000,)) -> Result:
    n = len(step_seq_ids)
    return Result(np.asarray(step_seq_ids, np.int64), np.zeros(n, np.int32), np.zeros(n, np.float32), np.ones(n, np.uint8))


PREPARE = valid_prepare()


def agreed_scheduler(world: int = 2, max_inflight: int = 1, ready_is_go: bool = False) -> SchedulerConversation:
    """Every rank's HELLO received; the WELCOME not sent yet."""
    conv = SchedulerConversation(world_size=world, run_id=RUN_ID, max_inflight=max_inflight, ready_is_go=ready_is_go)
    for rank in range(world):
        conv.receive(rank, frame(hello(rank, world)), 0.0)
    return conv


def running_scheduler(world: int = 2, max_inflight: int = 1, ready_is_go: bool = False) -> SchedulerConversation:
    conv = agreed_scheduler(world, max_inflight, ready_is_go)
    conv.welcome()
    return conv


def welcomed_executor(rank: int = 0, world: int = 2, ready_is_go: bool = False) -> ExecutorConversation:
    conv = ExecutorConversation(rank=rank, world_size=world, run_id=RUN_ID, geometry=GEOMETRY, model_fingerprint="w")
    conv.hello()
    conv.receive(frame(Welcome(V, LAYOUT_VERSION, world, GEOMETRY, ready_is_go)))
    return conv
