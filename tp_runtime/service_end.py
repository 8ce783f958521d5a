"""The end-of-service mark across hosts, in the rendezvous store.

Under `tp-runtime serve` every host's agent restarts its ranks for as long as the service lasts,
and only the frontend, on node 0, decides that it has ended (a crash loop, or a drain). The other
hosts' agents would otherwise wait in the rendezvous for a node 0 that will not come back. So node
0's launcher, once its frontend has exited, puts the frontend's exit code in the store it hosts
and waits (briefly) until every other host has seen it; each other host's launcher watches for the
mark and then ends its own launch: at once after a failure, after its ranks' own exit after a drain.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from tp_runtime.agent_stop import AgentStop

log = logging.getLogger("tp_runtime.launch")

END_KEY = "tp-runtime/service-end"  # the frontend's exit code
SEEN_KEY = "tp-runtime/service-end-seen"  # how many other hosts have seen it
POLL_S = 0.25
SEEN_WAIT_S = 5.0  # node 0 keeps its store up this long at most for the other hosts to see the mark
DRAIN_GRACE_S = 10.0  # after a drain, the other hosts' ranks exit by themselves within this


def announce(store, code: int, others: int, timeout_s: float = SEEN_WAIT_S) -> bool:  # noqa: ANN001 (torch Store)
    """Node 0: marks the end with the frontend's exit code; True once `others` hosts have seen it."""
    store.set(END_KEY, str(code))
    deadline = time.monotonic() + timeout_s
    while store.add(SEEN_KEY, 0) < others:
        if time.monotonic() > deadline:
            log.warning("not every host saw the end of the service within %g s", timeout_s)
            return False
        time.sleep(0.05)
    return True


class EndWatch:
    """A host other than node 0: a thread that watches the rendezvous store for the mark, says it
    has seen it, and ends this host's launch through `end` (its ranks, then its agent)."""

    def __init__(self, host: str, port: int, end: Callable[[], None]) -> None:
        self.code: int | None = None  # the frontend's exit code, once the mark is seen
        self._finished = threading.Event()  # set once the launcher's agent has returned
        self._host, self._port = host, port
        self._end = end
        self._thread = threading.Thread(target=self._watch, name="service-end", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """The launcher, once its agent has returned: the watch stops, and the launcher leaves only
        after its store calls have (tp_runtime/agent_stop.py says why)."""
        self._finished.set()
        self._thread.join(DRAIN_GRACE_S)

    def _watch(self) -> None:
        import torch.distributed as dist

        try:
            store = dist.TCPStore(self._host, self._port, is_master=False, timeout=timedelta(seconds=60))
            while not store.check([END_KEY]):
                if self._finished.wait(POLL_S):
                    return
            code = int(store.get(END_KEY))
            store.add(SEEN_KEY, 1)
        except Exception as exc:  # noqa: BLE001 - the store is gone: so is node 0, and the agent's rendezvous fails by itself
            log.info("stopped watching for the end of the service: %s", exc)
            return
        self.code = code
        log.warning("the service ended on node 0 (the frontend exited with code %d): this host stops", code)
        # After a drain the ranks were told to stop: they exit 0 and the agent returns by itself.
        if code == 0 and self._finished.wait(DRAIN_GRACE_S):
            return
        self._end()


def end_launch(ranks: Callable[[], list[int]], agent: AgentStop) -> None:
    """SIGKILLs this host's ranks, then stops torchrun's agent if it still runs."""
    for pid in ranks():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.stop()
