"""The rendezvous settings the launcher gives torchrun, read back by torch's own parser and handler."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

from tp_runtime import launcher as launch
from tp_runtime.config import RuntimeConfig
from tp_runtime.supervisor import stop_heartbeats


def agent_rendezvous(config: RuntimeConfig):  # noqa: ANN201 (torch's handler)
    """The rendezvous handler torchrun's agent builds from the launcher's arguments, against a store
    hosted here as the launcher hosts its own."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    from torch.distributed.run import config_from_args, get_args_parser

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    endpoint = f"127.0.0.1:{store.port}"
    argv = launch.torchrun_argv(config, endpoint, "127.0.0.1", ["serve"])
    launch_config, _, _ = config_from_args(get_args_parser().parse_args(argv))
    params = RendezvousParameters(
        backend=launch_config.rdzv_backend,
        endpoint=launch_config.rdzv_endpoint,
        run_id=launch_config.run_id,
        min_nodes=launch_config.min_nodes,
        max_nodes=launch_config.max_nodes,
        local_addr=launch_config.local_addr,
        **launch_config.rdzv_configs,
    )
    return get_rendezvous_handler(params), store


@pytest.mark.parametrize(("nnodes", "keep_alive_s"), [(1, launch.ONE_HOST_KEEP_ALIVE_S), (2, 5)])
def test_only_a_one_host_agent_keeps_its_heartbeats_rare(nnodes: int, keep_alive_s: int) -> None:
    handler, store = agent_rendezvous(RuntimeConfig(model="m", nnodes=nnodes, master_addr="127.0.0.1"))
    try:
        assert handler._settings.keep_alive_interval == timedelta(seconds=keep_alive_s)
    finally:
        stop_heartbeats(handler)
        del handler, store


def test_a_one_host_agent_meets_the_rendezvous_again_after_its_heartbeat_went_stale() -> None:
    # A restart re-runs the rendezvous: this node leaves it and joins it again, which stamps a fresh
    # heartbeat, so the restart does not depend on how old the last one is (hourly on one host).
    handler, store = agent_rendezvous(RuntimeConfig(model="m"))
    try:
        first = handler.next_rendezvous()
        assert (first.rank, first.world_size) == (0, 1)
        holder, node = handler._state_holder, handler._this_node
        holder.sync()
        holder.state.last_heartbeats[node] -= timedelta(days=1)  # dead by any interval
        holder.mark_dirty()
        assert holder.sync()
        again = handler.next_rendezvous()
        assert (again.rank, again.world_size) == (0, 1)
        assert holder.state.round == 1 and node in holder.state.participants
    finally:
        stop_heartbeats(handler)
        del handler, store


def test_each_rank_takes_the_users_thread_count_or_its_share_of_the_cores(monkeypatch):
    rank_threads = launch.rank_threads
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert (rank_threads(1), rank_threads(4), rank_threads(32)) == (16, 4, 1)
    for given, threads in (("6", 6), ("8,1", 8), (" 3 ", 3), ("0", 4), ("many", 4), ("", 4)):
        monkeypatch.setenv("OMP_NUM_THREADS", given)
        assert rank_threads(4) == threads, given
