"""The protocol's conversation, as two pure state machines: one for the scheduler, one per executor.

Sans-IO, in the manner of h11: no sockets and no clocks. The caller hands each decoded frame (or the
ProtocolError the codec raised for it) to `receive` and gets typed events back; it asks the machine
for every frame it sends (`prepare`, `go`, `ready`, ...), which raises UsageError when the call is not
legal now, and hands the returned `Outgoing` to its endpoint unchanged. Timeouts are the caller's: it
reads `unanswered(step)`, `unfinished(step)` and `last_heard` and decides. A peer's mistake is never
an exception here, only an event (ProtocolViolation, Refused, ...).

This module is the one place that knows the order of frames, the step numbering, the READY sets,
version negotiation and the handshake's checks, and the one caller of the envelope check.

The conversation (docs/protocol.md, "The step"):

    executor                                   scheduler
    HELLO ------------------------------------>  every rank's HELLO agrees: WELCOME to all
          <------------------------------------  WELCOME (negotiated version, geometry)
          <------------------------------------  PREPARE(N)            N = last step + 1
    READY(N) | REJECT(N) --------------------->  all READY: GO(N); else ABORT(N) (N is used up)
          <------------------------------------  GO(N) | ABORT(N)
          <------------------------------------  PREPARE(N+1)  (pipelined: once GO(N) is out,
                                                  when max_inflight > 1)
    RESULT(N) from rank 0, DONE(N) from the others, in step order
    HEARTBEAT either way at any time; SHUTDOWN from the scheduler ends it

A PREPARE(N) may travel as CONTINUE(N) when step N is step N-1's sequences one token on: each rank
answers it as the PREPARE it expands to after the PREPARE(N-1) it accepted (protocol.continuation),
and refuses it with STEP_NOT_HELD when it accepted none.

A group of one rank is WELCOMEd with ready_is_go: its READY(N) is its GO(N), and no GO travels.

The scheduler's loop (the engine), in outline:

    conv = SchedulerConversation(world_size=2, run_id=run_id, planned=scheduler.config, max_inflight=2)
    while conv.phase is Phase.HANDSHAKE:             # and the handshake deadline has not passed
        got = endpoint.recv(200)
        for event in conv.receive(got.rank, got.frame or got.error, time.monotonic()) if got else ():
            if isinstance(event, HandshakeRefused):
                endpoint.send_all(conv.ranks, *conv.shutdown(event.message))   # then fail
    endpoint.version = conv.version
    endpoint.send_all(conv.ranks, *conv.welcome())
    ...
    endpoint.send_all(conv.ranks, *conv.prepare(plan.step, plan.prepare, plan.brief))   # CONTINUE if it can
    for event in conv.receive(rank, frame_or_error, now):
        StepReady(N)     -> endpoint.send_all(conv.ranks, *conv.go(N)) unless go(N) is None (one
                            rank, ready_is_go); maybe prepare N+1 now
        StepRefused(N)   -> endpoint.send_all(conv.ranks, *conv.abort(N, reason)); fail event.seq_ids'
                            requests (or the whole step when it is empty) and plan again
        StepDone(N)      -> scheduler.on_result(plan_of[N], event.result)
    a request waits while a GOed step of several forwards runs: endpoint.send_all(conv.ranks, *conv.cut(N))
        StepFailed, RankShutdown -> the group cannot go on
        ProtocolViolation -> abort the step waiting for answers, if any; after GO, fail
    deadline passed while conv.unanswered(N): abort(N) naming those ranks (conv.who(rank))

Each executor's loop (the worker), in outline:

    conv = ExecutorConversation(rank=r, world_size=w, run_id=run_id, geometry=g, model_fingerprint=fp,
                                config_fingerprint=options_fp, host=socket.gethostname())
    endpoint.send(*conv.hello())
    while True:
        try:
            got = endpoint.recv(timeout_ms)          # None on timeout
        except ProtocolError as exc:
            got = exc
        for event in conv.receive(got) if got is not None else ():
            Welcomed          -> endpoint.version = event.version
            WelcomeRefused    -> exit: this rank cannot run what the scheduler chose
            PrepareReceived   -> page tables, inputs, clears; endpoint.send(*conv.ready(event.step)),
                                 or endpoint.send(*conv.reject(event.step, error)) if those fail;
                                 with conv.ready_is_go, READY is followed by the forward as on GO
            GoReceived        -> forward; endpoint.send(*conv.result(event.step, result)) on rank 0,
                                 endpoint.send(*conv.done(event.step)) elsewhere
            CutReceived       -> rank 0 ends the running step after the forward running now
            AbortReceived     -> drop the staged inputs (event.dropped) and the held page tables
            Refused           -> endpoint.send(*conv.reject(event.step, event.error))
            ShutdownReceived  -> exit
            Ignored           -> log
"""

from protocol.conversation.common import Outgoing, Phase
from protocol.conversation.executor_side import (
    AbortReceived,
    CutReceived,
    ExecutorConversation,
    ExecutorEvent,
    GoReceived,
    Ignored,
    PrepareReceived,
    Refused,
    ShutdownReceived,
    Welcomed,
    WelcomeRefused,
)
from protocol.conversation.scheduler_events import (
    HandshakeComplete,
    HandshakeRefused,
    ProtocolViolation,
    RankShutdown,
    Rejection,
    SchedulerEvent,
    StepDone,
    StepFailed,
    StepReady,
    StepRefused,
)
from protocol.conversation.scheduler_handshake import PLANNED_FIELDS, PlannedGeometry
from protocol.conversation.scheduler_side import SchedulerConversation

__all__ = [
    "PLANNED_FIELDS", "AbortReceived", "CutReceived", "ExecutorConversation", "ExecutorEvent", "GoReceived", "HandshakeComplete",
    "HandshakeRefused", "Ignored", "Outgoing", "Phase", "PlannedGeometry", "PrepareReceived", "ProtocolViolation",
    "RankShutdown", "Refused", "Rejection", "SchedulerConversation", "SchedulerEvent", "ShutdownReceived", "StepDone",
    "StepFailed", "StepReady", "StepRefused", "WelcomeRefused", "Welcomed",
]
