"""`tp-runtime generate` on one host: the launcher starts the frontend and the ranks itself, without
torchrun's elastic agent.

    launcher (it has imported torch and resolved the configuration to check the options)
     |-- frontend: `python -m tp_runtime.frontend`, started first; rank 0 reads its endpoint from
     |   the frontend's pipe once its shard has loaded
     '-- rank 0 .. N-1: forked from the launcher on the CPU, started as `python -m tp_runtime
         generate` with torchrun's variables where CUDA may be used

A one-shot command needs none of what the agent is for: restarts (`serve`, tp_runtime/supervisor.py)
and a rendezvous across hosts (`--nnodes`). What it cost a `generate` here (scripts/bench_startup.py,
docs/reports.md): the agent's imports and c10d rendezvous before the ranks start, its monitor loop's
CPU while they run, and the frontend's start between rank 0's process group and its load. Forking
gives each rank the launcher's torch and the model's parsed metadata (executor.model.load opens a
GGUF once per process): a rank's interpreter and imports cost it more CPU than its load from the
weight cache. A CUDA context does not survive a fork (and the launcher's torch.cuda check may have
made one), so with CUDA the ranks are new interpreters, as torchrun starts them.

Each rank runs what it runs under torchrun (tp_runtime/worker_process.py), with the variables
torchrun would set; the launcher binds the process group's store socket and hands it to rank 0.
Every process gets a session of its own, so that a Ctrl-C reaches the launcher alone: SIGINT or
SIGTERM goes to every child, and SIGKILL follows after STOP_MARGIN_S. Once one process has exited the
others get STOP_MARGIN_S to follow (a stopped one none: launcher.end_stragglers). The exit code is
0 when every process exited 0, the frontend's when it failed, else 1: whoever failed has said why.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass

from tp_runtime import hosts
from tp_runtime.bootstrap import BOOTSTRAP_FD_ENV, FrontendStart, frontend_nice, spawn_frontend
from tp_runtime.config import ConfigError, RuntimeConfig
from tp_runtime.launcher import LAUNCHER_PID_ENV, RANK_ENDED_SIGNAL, STOP_MARGIN_S, Stop, end_stragglers, live_children, rank_threads
from tp_runtime.worker_process import STORE_FD_ENV


LOOPBACK = "127.0.0.1"
EXIT_USAGE = 2
# A forked rank keeps the launcher's command line and, in /proc, its environment: its main thread's
# name (/proc/PID/comm) says which rank it is, for ps and the test harness.
RANK_THREAD_PREFIX = "tp-rank"
_PR_SET_NAME = 15


def runs_locally(config: RuntimeConfig, argv: list[str]) -> bool:
    """`generate` on one host starts its own processes; `serve` keeps the agent's restarts."""
    return argv[:1] == ["generate"] and not config.multi_node


@dataclass(frozen=True)
class RankStart:
    """How rank `rank` is started: the variables torchrun would give it, and the descriptors it inherits."""

    rank: int
    env: dict[str, str]
    fds: tuple[int, ...]


def rank_starts(world: int, threads: int, bootstrap_fd: int, store: socket.socket | None) -> list[RankStart]:
    port = str(store.getsockname()[1]) if store is not None else "0"
    starts = []
    for rank in range(world):
        env = {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": LOOPBACK, "MASTER_PORT": port,
            "OMP_NUM_THREADS": str(threads),
        }  # fmt: skip
        fds: tuple[int, ...] = ()
        if rank == 0:
            env[BOOTSTRAP_FD_ENV] = str(bootstrap_fd)
            fds = (bootstrap_fd,)
            if store is not None:
                env[STORE_FD_ENV] = str(store.fileno())
                fds += (store.fileno(),)
        starts.append(RankStart(rank, env, fds))
    return starts


def launch_generate(config: RuntimeConfig, argv: list[str]) -> int:
    """Runs `generate` (argv) on this host's ranks and its frontend; the launch's exit code."""
    from tp_runtime.resolve import uses_cuda

    use_cuda = uses_cuda(config)
    world = config.tensor_parallel_size
    threads = rank_threads(world)  # as under torchrun (launcher.launch)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    # Forking is safe while this process has no other thread (none holds a lock the child would inherit
    # held) and no CUDA context.
    fork = not use_cuda and threading.active_count() == 1
    frontend = spawn_frontend(config, "generate", argv, [], frontend_nice(config, use_cuda), new_session=True)
    store = hosts.listen_socket(LOOPBACK, 0) if world > 1 else None
    pids = [frontend.process.pid]
    try:
        for start in rank_starts(world, threads, frontend.bootstrap_fd, store):
            pids.append(_fork_rank(config, argv, start, threads) if fork else _spawn_rank(argv, start))
    except BaseException:
        _kill(pids)
        raise
    finally:
        os.close(frontend.bootstrap_fd)  # the ranks hold their own copies
        if store is not None:
            store.close()
    Stop(STOP_MARGIN_S, force=lambda: _kill(live_children()), signals=(signal.SIGTERM, signal.SIGINT))
    end_stragglers(STOP_MARGIN_S)
    codes = _wait_all(pids, frontend.process.pid)
    return _exit_code(frontend, codes)


def _exit_code(frontend: FrontendStart, codes: dict[int, int]) -> int:
    frontend.process.returncode = codes[frontend.process.pid]  # reaped here, not by Popen
    if all(code == 0 for code in codes.values()):
        return 0
    return frontend.process.returncode or 1


def _fork_rank(config: RuntimeConfig, argv: list[str], start: RankStart, threads: int) -> int:
    """A rank as a fork of this process: it never returns here; its exit code is run_worker's."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        _name_thread(f"{RANK_THREAD_PREFIX}{start.rank}")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.update(start.env)
        import torch

        from executor.model import ModelLoadError
        from tp_runtime.worker_process import run_worker

        torch.set_num_threads(threads)  # OpenMP read OMP_NUM_THREADS when the launcher loaded torch
        try:
            code = run_worker(config, "generate", argv)
        except (ConfigError, ModelLoadError) as exc:
            sys.stderr.write(f"tp-runtime: error: {exc}\n")
            code = EXIT_USAGE
    except BaseException:  # noqa: BLE001 - the launcher's stack is not this process's to unwind
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _name_thread(name: str) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _spawn_rank(argv: list[str], start: RankStart) -> int:
    """A rank as a new interpreter, as torchrun starts one."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tp_runtime", *argv], env={**os.environ, **start.env}, pass_fds=start.fds,
        start_new_session=True,
    )
    return child.pid


def _wait_all(pids: list[int], frontend: int) -> dict[int, int]:
    """Every process's exit code (a signal's death as 128 + its number), once all have exited. A rank
    that fails while the frontend runs is reported to the frontend at once (RANK_ENDED_SIGNAL): one
    that died before its HELLO left it nothing to notice, and it waited in its handshake until the
    stragglers' watch killed it, its ipc directory left behind."""
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:  # reaped elsewhere: nothing is left to wait for
            break
        if pid in pids:
            codes[pid] = os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
            if pid != frontend and codes[pid] != 0 and frontend not in codes:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(frontend, RANK_ENDED_SIGNAL)
    return {pid: codes.get(pid, 1) for pid in pids}


def _kill(pids) -> None:  # noqa: ANN001 - any iterable of pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
