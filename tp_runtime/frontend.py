"""The frontend process: the scheduler and the HTTP server or the CLI job.

Under `tp-runtime serve` it is the launcher's child, beside the ranks (on node 0 across hosts), and
outlives every executor group (--launcher-fd: tp_runtime/supervisor.py, tp_runtime/group_broker.py); under plain torchrun,
and for `generate`, it is rank 0's child (--bootstrap-fd) and ends with the group. It imports no
torch, so its Python work never competes with rank 0's model step for a GIL. It dies with its parent
(PR_SET_PDEATHSIG), failing every request in flight with a clear error and removing its ipc
directory first.

Its endpoint (tp_runtime/group_endpoints.py): on one host an ipc:// socket in a 0700 directory;
across hosts tcp on the address the other hosts reach this one by (tp_runtime.hosts.scheduler_address),
never a loopback address when a peer is on another host.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Callable

from protocol.transport import SchedulerEndpoint, ipc_address, remove_private_dirs
from scheduler.scheduler import Scheduler, SchedulerConfig
from tp_runtime.bootstrap import Bootstrap, BootstrapRequest, write_bootstrap
from tp_runtime.config import ConfigError, RuntimeConfig
from tp_runtime.engine import Engine
from tp_runtime.group_broker import BootstrapServer, GroupBroker, read_launcher, send_line
from tp_runtime.group_endpoints import open_group, tcp_address
from tp_runtime.launcher import LAUNCHER_PID_ENV, RANK_ENDED_SIGNAL
from tp_runtime.recovery import Recovery, RecoveryPolicy
from tp_runtime.signal_watch import SignalWatch, dump_stacks_on_signal
from tp_runtime.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("tp_runtime.frontend")

PARENT_DIED = signal.SIGHUP
EXIT_DEADLINE_S = 8.0  # the longest the frontend's clean-up may take once it is exiting (engine join: up to 10 s is a hang)
RANK_0_GONE = "rank 0 exited: the runtime is down"
LAUNCHER_GONE = "the launcher exited: the runtime is down"
RANK_ENDED = "a rank exited with a failure (the launcher saw it): the runtime is down"
FAILED_LINGER_S = 1.0  # a failed runtime answers /health with 503 this long before it exits
QUEUED_REQS_PER_SEQ = 8  # the default bound on requests in flight, per running slot


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(PARENT_DIED), 0, 0, 0)


def single_host() -> bool:
    return os.environ.get("LOCAL_WORLD_SIZE", "1") == os.environ.get("WORLD_SIZE", "1")


def _first_address(config: RuntimeConfig) -> str:
    if single_host():
        return ipc_address()
    return tcp_address(config, os.environ.get("MASTER_ADDR", config.master_addr))


def build_engine(
    config: RuntimeConfig, endpoint: SchedulerEndpoint, tokenizer: Tokenizer, recovery: Recovery | None = None
) -> Engine:
    scheduler = Scheduler(
        SchedulerConfig(
            num_kv_pages=config.num_kv_pages,
            page_size=config.page_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            eos_token_ids=tuple(tokenizer.eos_token_ids),
            num_host_pages=config.num_host_pages,
            enable_prefix_cache=config.enable_prefix_caching,
            max_inflight_steps=2 if config.async_scheduling else 1,
            num_scheduler_steps=config.num_scheduler_steps,
            poison_freed_pages=config.debug_poison_freed_pages,
        )
    )
    return Engine(
        scheduler=scheduler,
        endpoint=endpoint,
        world_size=config.tensor_parallel_size,
        model_name=served_model_names(config)[0],
        max_model_len=config.max_model_len,
        max_num_queued_reqs=config.max_num_queued_reqs or QUEUED_REQS_PER_SEQ * config.max_num_seqs,
        recovery=recovery,
    )


def served_model_names(config: RuntimeConfig) -> tuple[str, ...]:
    """--served-model-name, or the --model path as given: what vLLM reports for a local model."""
    return tuple(config.served_model_name) or (config.model,)


def arguments() -> argparse.ArgumentParser:
    """The frontend's command line, as its two parents build it (tp_runtime/bootstrap.py, supervisor.py)."""
    parser = argparse.ArgumentParser(prog="python -m tp_runtime.frontend")
    way = parser.add_mutually_exclusive_group(required=True)
    way.add_argument("--bootstrap-fd", type=int, help="rank 0's child: the pipe its Bootstrap goes back on")
    way.add_argument("--launcher-fd", type=int, help="the launcher's child: its socket pair (tp_runtime/supervisor.py)")
    parser.add_argument("--config", required=True)
    parser.add_argument("--mode", choices=("serve", "generate"), required=True)
    parser.add_argument("--client-keys", default="", help="the ranks' CURVE public keys (Z85), comma-separated, in rank order")
    parser.add_argument("job", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    config = RuntimeConfig.from_json(args.config)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s [frontend] %(levelname)s %(name)s: %(message)s")
    dump_stacks_on_signal()
    if args.launcher_fd is not None:
        return _main_supervised(config, socket.socket(fileno=args.launcher_fd))
    engine: Engine | None = None
    down: list[str] = []  # why the runtime is down, as signals said it (also before `engine` exists)

    # Its parent: rank 0 under torchrun, the launcher under `tp-runtime generate` (tp_runtime/local_launch.py).
    gone = LAUNCHER_GONE if os.environ.get(LAUNCHER_PID_ENV) == str(os.getppid()) else RANK_0_GONE

    def runtime_down(reason: str) -> Callable[[], None]:
        # A mark and the engine's failure, never an exception: one raised in the main thread lands
        # wherever it happens to be, and a library's `except BaseException` there swallowed it (a
        # frontend left waiting for a HELLO that never came). The engine's failure takes the main
        # thread out through the finally below, which removes the ipc directory.
        def mark() -> None:
            down.append(reason)
            if engine is not None:
                engine.fail(reason)

        return mark

    signals = SignalWatch()
    signals.on(PARENT_DIED, runtime_down(gone))  # before anything that needs cleaning up exists
    signals.on(RANK_ENDED_SIGNAL, runtime_down(RANK_ENDED))
    _die_with_parent()
    request = BootstrapRequest(0, tuple(k for k in args.client_keys.split(",") if k))
    endpoint: SchedulerEndpoint | None = None
    try:
        try:
            opened = open_group(config, _first_address(config))
        except ConfigError as exc:
            if not write_bootstrap(args.bootstrap_fd, Bootstrap(error=str(exc))):  # nobody took the refusal: said here
                sys.stderr.write(f"tp-runtime: error: {exc}\n")
            return 2
        endpoint = opened.endpoint
        if not write_bootstrap(args.bootstrap_fd, opened.answer(request, config.tensor_parallel_size)):
            sys.stderr.write(f"tp-runtime: error: the runtime failed: {down[0] if down else gone}\n")
            return 1
        tokenizer = load_tokenizer(config.model, config.tokenizer, config.chat_template)
        engine = build_engine(config, endpoint, tokenizer)
        if down:  # a signal came before `engine` was bound
            engine.fail(down[0])
        engine.start()
        if args.mode == "serve":
            return _serve(engine, tokenizer, config, signals, gone)
        from tp_runtime.cli import run_generate_job

        return run_generate_job(engine, tokenizer, [a for a in args.job if a != "--"])
    finally:
        _exit_within(EXIT_DEADLINE_S)
        remove_private_dirs()  # first: rank 0 may have died between making the directory and the bind
        if engine is not None:
            engine.shutdown("the frontend exited")
        if endpoint is not None:
            endpoint.close()


def _main_supervised(config: RuntimeConfig, launcher: socket.socket) -> int:
    """Under `tp-runtime serve`: every executor group gets its own endpoint, run id and key from the
    broker, the engine replaces a group that fails, and the service lasts until a drain, a crash
    loop or the launcher's end."""
    engine: Engine | None = None
    parent_gone = threading.Event()

    def parent_died() -> None:  # see main()
        parent_gone.set()
        if engine is not None:
            engine.fail(LAUNCHER_GONE)

    signals = SignalWatch()
    signals.on(PARENT_DIED, parent_died)
    _die_with_parent()
    broker: GroupBroker | None = None
    server: BootstrapServer | None = None
    try:
        broker = GroupBroker(launcher, config)
        server = BootstrapServer(broker)
        tokenizer = Tokenizer.from_model_path(config.model)
        policy = RecoveryPolicy(config.max_restarts, config.restart_window, config.recovery_timeout)
        engine = build_engine(config, broker.open_group(), tokenizer, Recovery(broker, policy))
        if parent_gone.is_set():
            engine.fail(LAUNCHER_GONE)
        read_launcher(broker, launcher, on_gone=lambda: engine.fail(LAUNCHER_GONE))
        engine.start()
        server.start()
        send_line(launcher, {"ready": server.path})
        return _serve(engine, tokenizer, config, signals, LAUNCHER_GONE)
    finally:
        _exit_within(EXIT_DEADLINE_S, lambda: None if broker is None else broker.directory)
        if server is not None:
            server.close()
        if engine is not None:
            engine.shutdown("the frontend exited")
            engine.close()
        if broker is not None:
            broker.close()


def _exit_within(seconds: float, directory: Callable[[], str | None] = lambda: None) -> None:
    """Once the frontend is on its way out nothing may keep it alive: the engine thread stuck in a
    call, or a zmq context whose term() waits on a socket another thread still holds, would leave a
    frontend without a runtime behind it (seen once in the long stress run after kill -9 of rank 0).
    A forced exit still removes the sockets' directories, `directory()` (the broker's) and
    ipc_address()'s: a CI run once found the broker's left behind after kill -9 of the launcher,
    every process gone, which only an exit before broker.close() leaves. Nothing here may keep
    os._exit from running: the main thread may be removing the same directories, and stderr may
    be a pipe whose reader is gone (the write raises) or stalled (made non-blocking first, a
    write that would wait raises too)."""

    def force() -> None:
        try:
            leftover = directory()
            if leftover is not None:
                shutil.rmtree(leftover, ignore_errors=True)
            remove_private_dirs()
        finally:
            try:
                os.set_blocking(sys.stderr.fileno(), False)
                sys.stderr.write(f"tp-runtime: error: the frontend did not finish exiting within {seconds:g} s: exiting now\n")
                sys.stderr.flush()
            finally:
                os._exit(1)

    timer = threading.Timer(seconds, force)
    timer.daemon = True
    timer.start()


def _serve(engine: Engine, tokenizer: Tokenizer, config: RuntimeConfig, signals: SignalWatch, parent_gone: str) -> int:
    from tp_runtime.cli import API_KEY_ENV
    from tp_runtime.http import ServerSettings, create_app
    from tp_runtime.http.server import http_server
    from tp_runtime.heap import freeze_startup_objects

    settings = ServerSettings(
        served_model_names(config),
        model_path=config.model,
        api_key=os.environ.get(API_KEY_ENV) or None,
        require_api_key_for_metrics=config.require_api_key_for_metrics,
        bind_host=config.host,
        max_request_body_size=config.max_request_body_size,
        max_prompt_chars=config.max_prompt_chars,
        request_body_timeout_s=config.request_body_timeout,
        max_logprobs=config.max_logprobs,
    )
    app = create_app(engine, tokenizer, settings)
    freeze_startup_objects()
    server = http_server(
        app, config.host, config.port, config.uvicorn_log_level or config.log_level, config.timeout_keep_alive,
        config.request_header_timeout,
    )
    # uvicorn in a non-main thread installs no signal handlers: this process's SignalWatch owns
    # SIGTERM (drain) and PARENT_DIED (fail fast).
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    stop = threading.Event()

    def drain() -> None:
        log.info("SIGTERM: draining (up to %g s)", config.shutdown_timeout)
        # A thread of its own: the signal watch stays free for a PARENT_DIED during the drain.
        threading.Thread(target=lambda: (engine.drain(config.shutdown_timeout), stop.set()), daemon=True).start()

    def parent_died() -> None:
        engine.fail(parent_gone)
        stop.set()

    signals.on(signal.SIGTERM, drain)
    signals.on(PARENT_DIED, parent_died)
    signals.on(signal.SIGINT, drain)
    thread.start()
    log.info("serving %s on http://%s:%d", engine.model_name, config.host, config.port)
    # Every way out passes through the engine: a drain or a parent's death ends it, a failure marks it.
    engine.wait_down()
    if engine.failed:  # said whichever way it came, the parent's death included
        sys.stderr.write(f"tp-runtime: error: the runtime failed: {engine.health().reason}\n")
        if not stop.is_set():  # a failure of the group: /health answers 503 a moment before the exit
            stop.wait(FAILED_LINGER_S)
    server.stop()
    thread.join(timeout=5)
    return 1 if engine.failed else 0


if __name__ == "__main__":
    sys.exit(main())
