"""The convenience launcher: `tp-runtime serve|generate` outside torchrun re-enters itself through
torch.distributed's own launcher (`torch.distributed.run`, c10d rendezvous), so that the canonical
`torchrun ... -m tp_runtime serve` and the convenience command are the same code path. Across hosts
the same command runs on every host (`--nnodes N --node-rank K --master-addr H --master-port P`).
Under `serve` node 0 (the rendezvous host) runs the frontend beside its agent, and every host's
agent restarts its ranks when the executor group fails (tp_runtime/supervisor.py,
tp_runtime/service_end.py); for `generate` the host that the rendezvous gives global rank 0 runs the
frontend as that rank's child. What each rank then does is tp_runtime/worker_process.py.

Where things listen: torch's TCPStore binds every interface whatever host it is given, and gloo
binds the address the host name resolves to. So the launcher hosts the rendezvous store itself, on
a socket bound to loopback (one host) or to --master-addr (host 0 of several), and has torchrun's
agent join it as a client; rank 0 hosts the process group's store the same way on MASTER_ADDR; and
gloo is bound to the interface that reaches MASTER_ADDR. On one host nothing listens beyond
loopback but the HTTP server.

Stopping: SIGTERM (to node 0's launcher across hosts) drains for at most --shutdown-timeout seconds,
and the launcher gives torchrun a grace period STOP_MARGIN_S longer, so that the drain always ends
before torchrun kills the ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

from tp_runtime import hosts, torch_floor
from tp_runtime.config import ConfigError, RuntimeConfig

log = logging.getLogger("tp_runtime.launch")

# torch.distributed.elastic waits this long after passing SIGTERM on before it SIGKILLs the ranks,
# unless torchrun's --shutdown-timeout or TORCH_ELASTIC_SHUTDOWN_TIMEOUT says otherwise (torch 2.13:
# LaunchConfig.shutdown_timeout).
TORCHRUN_DEFAULT_GRACE_S = 30
# What a stop takes after the drain: SHUTDOWN to every rank, their exit, the frontend's exit.
STOP_MARGIN_S = 10.0
# What the launcher of `generate` sends its frontend when a rank exits with a failure: a rank that
# died before its HELLO leaves no connection to close, and the frontend would wait in its handshake.
RANK_ENDED_SIGNAL = signal.SIGUSR2
STORE_TIMEOUT_S = 60.0
RDZV_ID = "tp-runtime"
# The rendezvous keep-alive of a one-host launch, in seconds. Heartbeats tell the other hosts' agents
# that this one lives; with no other host only this node's own handler reads them (the agent's
# question whether anyone waits to join is off on one host: tp_runtime/supervisor.py), and each
# costs the launcher 3-7 ms of CPU (the state pickled and compare-set through the store, every 5 s
# by default: docs/control_plane.md, tenth sitting). A restart leaves the rendezvous and joins it
# again, which stamps a fresh heartbeat, so it does not depend on the last one's age.
ONE_HOST_KEEP_ALIVE_S = 3600
# The launcher's pid, for its workers: torchrun's agent runs in the launcher, so it is their parent.
LAUNCHER_PID_ENV = "TP_RUNTIME_LAUNCHER_PID"


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)

def torchrun_grace_s(config: RuntimeConfig) -> int:
    """The grace period the launcher gives torchrun: the drain plus the stop, at least torch's own."""
    return max(TORCHRUN_DEFAULT_GRACE_S, math.ceil(config.shutdown_timeout + STOP_MARGIN_S))

def check_drain_fits(config: RuntimeConfig) -> None:
    """Under plain torchrun: the drain must end before torchrun's grace period does."""
    raw = os.environ.get("PET_SHUTDOWN_TIMEOUT") or os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    grace = float(raw) if raw else TORCHRUN_DEFAULT_GRACE_S
    if config.shutdown_timeout + STOP_MARGIN_S <= grace:
        return
    needed = math.ceil(config.shutdown_timeout + STOP_MARGIN_S)
    if raw:
        raise ConfigError(
            f"--shutdown-timeout {config.shutdown_timeout:g} does not fit torchrun's grace period of {grace:g} s "
            f"(stopping takes up to {STOP_MARGIN_S:g} s more): give torchrun --shutdown-timeout {needed} or lower ours"
        )
    log.warning(
        "--shutdown-timeout %g needs torchrun's grace period to be at least %d s; torch's default is %d s unless "
        "torchrun was given --shutdown-timeout", config.shutdown_timeout, needed, TORCHRUN_DEFAULT_GRACE_S,
    )

def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

@contextlib.contextmanager
def _rendezvous(config: RuntimeConfig) -> Iterator[tuple[str, str, object]]:
    """(rendezvous endpoint, this host's address, the store where this host hosts it, else None)
    for torchrun, with the store listening on the endpoint's own address only while the launch runs
    (host 0 hosts it)."""
    import torch.distributed as dist

    if config.multi_node:
        local_addr = hosts.route_address(config.master_addr, config.master_port)
        endpoint = _host_port(config.master_addr, config.master_port)
        if config.node_rank != 0:
            yield endpoint, local_addr, None
            return
        store_ip = hosts.resolve(config.master_addr)
        if store_ip != local_addr:
            raise ConfigError(
                f"--node-rank 0 hosts the rendezvous on --master-addr {config.master_addr} ({store_ip}), "
                "which is not an address of this host"
            )
        listener = hosts.listen_socket(store_ip, config.master_port)
    else:
        local_addr = store_ip = "127.0.0.1"
        listener = hosts.listen_socket(store_ip, 0)
        endpoint = _host_port(store_ip, listener.getsockname()[1])
    # The store owns the descriptor from here (libuv closes it); it lives as long as the launch.
    store = dist.TCPStore(
        store_ip, listener.getsockname()[1], is_master=True, multi_tenant=True, wait_for_workers=False,
        timeout=timedelta(seconds=STORE_TIMEOUT_S), master_listen_fd=listener.detach(),
    )
    try:
        yield endpoint, local_addr, store
    finally:
        del store

@dataclass(frozen=True)
class TorchrunFlag:
    """One option the launcher gives torchrun. `required` False: an older torchrun lacks it, and the
    launch does without it (the comment where it is built says what is lost)."""

    name: str
    value: str
    required: bool = True

    def arg(self) -> str:
        return f"{self.name}={self.value}"


def torchrun_flags(config: RuntimeConfig, endpoint: str, local_addr: str, max_restarts: int = 0) -> list[TorchrunFlag]:
    """max_restarts: 0 where a failed rank ends the launch; under supervise() the agent restarts
    the group and the frontend's window decides when to stop (tp_runtime/recovery.py)."""
    return [
        TorchrunFlag("--nnodes", str(config.nnodes)),
        TorchrunFlag("--nproc-per-node", str(config.ranks_per_node)),
        TorchrunFlag("--rdzv-backend", "c10d"),
        TorchrunFlag("--rdzv-endpoint", endpoint),
        TorchrunFlag("--rdzv-id", RDZV_ID),
        TorchrunFlag("--rdzv-conf", rendezvous_conf(config)),
        TorchrunFlag("--local-addr", local_addr),  # the address rank 0's agent publishes as MASTER_ADDR
        TorchrunFlag("--max-restarts", str(max_restarts)),
        TorchrunFlag("--monitor-interval", "0.2"),
        # torch 2.12 on: its grace period before SIGKILL. Without it (torch 2.11) the agent waits its
        # fixed TORCHRUN_DEFAULT_GRACE_S; a drain still gets --shutdown-timeout, since the launcher,
        # not the agent, passes SIGTERM on and waits for the ranks (Stop).
        TorchrunFlag("--shutdown-timeout", str(torchrun_grace_s(config)), required=False),
        TorchrunFlag("--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT"),  # not SIGTERM: the launcher's (Stop)
    ]


def rendezvous_conf(config: RuntimeConfig) -> str:
    """The agent joins the store the launcher hosts (above) rather than hosting one."""
    conf = "is_host=false"
    if config.nnodes == 1:
        conf += f",keep_alive_interval={ONE_HOST_KEEP_ALIVE_S}"
    return conf


def torchrun_options(parser: argparse.ArgumentParser) -> frozenset[str]:
    """Every option string torchrun's parser accepts (argparse lists them on its actions)."""
    return frozenset(option for action in parser._actions for option in action.option_strings)


def torchrun_argv(
    config: RuntimeConfig,
    endpoint: str,
    local_addr: str,
    argv: list[str],
    supported: Collection[str] | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """torchrun's arguments, with only the options this torch's torchrun has (`supported`; by
    default asked of torch.distributed.run.get_args_parser()). A required one it lacks is refused
    here, in a sentence, rather than by argparse inside the launch."""
    if supported is None:
        from torch.distributed.run import get_args_parser

        supported = torchrun_options(get_args_parser())
    flags = torchrun_flags(config, endpoint, local_addr, max_restarts)
    lacking = [flag.name for flag in flags if flag.required and flag.name not in supported]
    if lacking:
        raise ConfigError(
            f"this torch's torchrun has no {', '.join(lacking)}: tp-runtime needs torch {torch_floor.MIN_TORCH_TEXT} or newer"
        )
    return [*(flag.arg() for flag in flags if flag.name in supported), "-m", "tp_runtime", *argv]


def quiet_torchrun(log_level: str) -> None:
    """At --log-level warning or error, the ranks and the frontend say what failed in one sentence;
    torchrun's agent would add its own lines (which process it signalled, which exit code it saw)
    and c10d its C++ warnings. c10d and some of the agent's loggers read these variables when torch
    loads: call this before it does."""
    if log_level in ("warning", "error"):
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        os.environ.setdefault("LOGLEVEL", "CRITICAL")  # the loggers torch.distributed.elastic gives a level
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def rank_threads(ranks: int) -> int:
    """The torch threads of each of this host's `ranks` ranks: OMP_NUM_THREADS where the user set
    it (its first level, where it lists nested ones: "8,1"), else an equal share of the cores."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else max(1, (os.cpu_count() or 1) // ranks)


def supervise(argv: list[str]) -> bool:
    """`serve` restarts a failed executor group (tp_runtime/supervisor.py), on every host of the
    launch; the frontend runs beside the agent on node 0 (`runs_frontend`). For `generate` the
    frontend is rank 0's child and a failed rank ends the launch."""
    return argv[:1] == ["serve"]


def runs_frontend(config: RuntimeConfig, argv: list[str]) -> bool:
    return supervise(argv) and config.node_rank == 0


def launch(config: RuntimeConfig, argv: list[str]) -> int:
    """Starts `python -m tp_runtime <argv>` on this host's ranks through torchrun's launcher, or for
    a `generate` on one host, without it (tp_runtime/local_launch.py)."""
    from tp_runtime.local_launch import launch_generate, runs_locally

    if runs_locally(config, argv):
        return launch_generate(config, argv)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    torch_floor.require_torch()
    from tp_runtime import service_end
    from tp_runtime.agent_stop import AgentStop
    from tp_runtime.bootstrap import SUPERVISED_ENV, frontend_nice
    from tp_runtime.recovery import AGENT_MAX_RESTARTS
    from tp_runtime.resolve import uses_cuda
    from tp_runtime.supervisor import Supervisor, agent_observed_by

    # Each rank gets its share of the cores (torchrun would otherwise set 1 and print a banner).
    os.environ.setdefault("OMP_NUM_THREADS", str(rank_threads(config.ranks_per_node)))
    supported = torchrun_options(get_args_parser())
    if "--shutdown-timeout" in supported:
        # The ranks check their drain against the grace period (check_drain_fits); a torchrun
        # without the option has its fixed default, which check_drain_fits assumes unset.
        os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(torchrun_grace_s(config))
    # No agent-hosted store for the process group: rank 0 hosts it on MASTER_ADDR (_process_group_store).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    supervised = supervise(argv)
    if supervised:
        os.environ[SUPERVISED_ENV] = "1"
    stop: Stop | None = None
    supervisor: Supervisor | None = None
    watch: service_end.EndWatch | None = None
    agent = AgentStop()
    end_here = functools.partial(service_end.end_launch, lambda: list(live_children()), agent)
    if runs_frontend(config, argv):
        stop = Stop(config.shutdown_timeout + STOP_MARGIN_S, force=agent.stop)
        supervisor = Supervisor(config, frontend_nice(config, uses_cuda(config)), agent)
        stop.targets = lambda: [supervisor.frontend.pid]
    elif supervised:
        # The service is node 0's to drain: a SIGTERM here takes this host out of it (the frontend
        # sees its ranks go and waits for them to rejoin). Its ranks hold nothing worth a grace
        # period, and its agent, stopped first, would restart them.
        signal.signal(signal.SIGTERM, lambda _signum, _frame: end_here())
    else:
        stop = Stop(config.shutdown_timeout + STOP_MARGIN_S, force=agent.stop)
        end_stragglers(STOP_MARGIN_S)
    max_restarts = AGENT_MAX_RESTARTS if supervised else 0
    observed = agent_observed_by(supervisor, config.nnodes) if supervised else contextlib.nullcontext()
    code = 0
    with _rendezvous(config) as (endpoint, local_addr, store), observed:
        if supervisor is not None:
            if config.multi_node:
                supervisor.before_end = lambda frontend_code: service_end.announce(store, frontend_code, config.nnodes - 1)
        elif supervised:  # another host than node 0
            watch = service_end.EndWatch(config.master_addr, config.master_port, end_here)
        torchrun_args = get_args_parser().parse_args(torchrun_argv(config, endpoint, local_addr, argv, supported, max_restarts))
        try:
            try:
                run(torchrun_args)
            finally:
                agent.returned()
        except SignalException as exc:
            if stop is not None and stop.forced:
                sys.stderr.write(
                    f"tp-runtime: error: the ranks did not stop within {stop.after_s:g} s of SIGTERM: stopped by force\n"
                )
                code = 1
            elif watch is not None and watch.code:
                sys.stderr.write(
                    f"tp-runtime: error: the service ended on node 0, the frontend's host ({config.master_addr}), "
                    f"with code {watch.code}: its error is there\n"
                )
                code = 1
            elif supervisor is None or not supervisor.ended:
                log.info("stopped by %s", exc.sigval.name)
        except ChildFailedError:  # the ranks or the frontend have said why
            code = 1
        except RendezvousError as exc:
            sys.stderr.write(f"tp-runtime: error: the rendezvous at {endpoint} failed: {exc}\n")
            code = 1
        finally:
            if watch is not None:
                watch.finish()
            if supervisor is not None:
                supervisor.close()
    if supervisor is not None and code == 0:
        return 0 if supervisor.frontend_code == 0 else 1  # the frontend has said why
    return code

class Stop:
    """SIGTERM to the launcher: the launcher, not torchrun's agent, passes it on to this host's ranks.

    They drain and exit by themselves, so every host's agent sees its ranks succeed and meets the
    others in torchrun's exit barrier; an agent stopped by a signal skips that barrier, and the
    other hosts' agents would wait there for it (torch's exit_barrier_timeout, 300 s). If the ranks
    are still there `after_s` seconds later, or at a second signal, the launcher calls `force`: it
    hands the stop to torchrun's agent (AgentStop), or where it started the processes itself kills them."""

    def __init__(
        self, after_s: float, force: Callable[[], None], signals: Iterable[signal.Signals] = (signal.SIGTERM,)
    ) -> None:
        self.after_s = after_s
        self.forced = False
        self._signalled = False
        self._force_stop = force
        # Who drains: the ranks (rank 0 passes it to its frontend child), or under supervise() the
        # frontend beside them, which tells the ranks to stop once it has drained.
        self.targets: Callable[[], Iterable[int]] = live_children
        for sig in signals:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, _signum: int, _frame: object) -> None:
        if self._signalled:
            self._force()
            return
        self._signalled = True
        for pid in self.targets():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        timer = threading.Timer(self.after_s, self._force)
        timer.daemon = True
        timer.start()

    def _force(self) -> None:
        self.forced = True
        self._force_stop()


def end_stragglers(after_s: float) -> None:
    """Once one of this host's ranks has exited, SIGKILLs those that stay: a stopped one (SIGSTOP,
    state T) at once, any other after_s.

    A rank exits when the group has finished (the others follow within a second) or failed (then the
    group cannot go on). torchrun's agent would send the others SIGTERM, which a stopped process
    never handles, and SIGKILL them only 30 s later. after_s covers rank 0's wait for its frontend
    and the ranks' agreement on the exit code; a stopped rank can do neither."""

    def watch() -> None:
        seen: set[int] = set()
        while not seen - set(live := live_children()):
            seen.update(live)
            time.sleep(0.2)
        deadline = time.monotonic() + after_s
        while children := live_children():
            for pid, state in children.items():
                if state == "T" or time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    threading.Thread(target=watch, name="stragglers", daemon=True).start()


def live_children() -> dict[int, str]:
    """This process's live children and their states: the ranks torchrun's agent started (it runs in
    this process); an exited one that the agent has not reaped yet is left out."""
    me, children = os.getpid(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None and int(fields[1]) == me and fields[0] != "Z":
            children[int(entry)] = fields[0]
    return children


def process_state(pid: int) -> str | None:
    """The state letter /proc gives a process (R, S, T, Z ...), None once it is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields is not None else None


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat past the command name: state, parent pid, ..."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
