"""The frontend process: rank 0's child that runs the scheduler and the HTTP server or the CLI job.

It imports no torch, so its Python work never competes with rank 0's model step for a GIL. It dies
with rank 0 (PR_SET_PDEATHSIG), failing every request in flight with a clear error first.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import uuid

from protocol.auth import new_key
from protocol.transport import SchedulerEndpoint, ipc_address
from scheduler.scheduler import Scheduler, SchedulerConfig
from tp_runtime.config import RuntimeConfig
from tp_runtime.engine import Engine
from tp_runtime.launch import pack_secrets
from tp_runtime.tokenizer import Tokenizer

log = logging.getLogger("tp_runtime.frontend")

PARENT_DIED = signal.SIGHUP
DRAIN_TIMEOUT_S = 30.0
FAILED_LINGER_S = 1.0  # a failed runtime answers /health with 503 this long before it exits
QUEUED_REQS_PER_SEQ = 8  # the default bound on requests in flight, per running slot


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(PARENT_DIED), 0, 0, 0)


def _bind_endpoint(key: bytes, run_id: str) -> SchedulerEndpoint:
    single_host = os.environ.get("LOCAL_WORLD_SIZE", "1") == os.environ.get("WORLD_SIZE", "1")
    if single_host:
        return SchedulerEndpoint(ipc_address(), key, run_id)
    endpoint = SchedulerEndpoint("tcp://0.0.0.0:0", key, run_id)
    port = endpoint.address.rsplit(":", 1)[1]
    host = os.environ.get("TP_RUNTIME_ADVERTISE_HOST") or socket.gethostbyname(socket.gethostname())
    endpoint.advertised_address = f"tcp://{host}:{port}"
    return endpoint


def build_engine(config: RuntimeConfig, endpoint: SchedulerEndpoint, tokenizer: Tokenizer) -> Engine:
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
    )


def served_model_names(config: RuntimeConfig) -> tuple[str, ...]:
    """--served-model-name, or the --model path as given: what vLLM reports for a local model."""
    return tuple(config.served_model_name) or (config.model,)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tp_runtime.frontend")
    parser.add_argument("--secrets-fd", type=int, required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--mode", choices=("serve", "generate"), required=True)
    parser.add_argument("job", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    _die_with_parent()
    config = RuntimeConfig.from_json(args.config)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s [frontend] %(levelname)s %(name)s: %(message)s")

    tokenizer = Tokenizer.from_model_path(config.model)
    key, run_id = new_key(), uuid.uuid4().hex
    endpoint = _bind_endpoint(key, run_id)
    address = getattr(endpoint, "advertised_address", endpoint.address)
    with os.fdopen(args.secrets_fd, "wb") as pipe:
        pipe.write(pack_secrets(key, run_id, address))
    engine = build_engine(config, endpoint, tokenizer)
    engine.start()
    try:
        if args.mode == "serve":
            return _serve(engine, tokenizer, config)
        from tp_runtime.cli import run_generate_job

        return run_generate_job(engine, tokenizer, [a for a in args.job if a != "--"])
    finally:
        engine.shutdown("the frontend exited")
        endpoint.close()


def _serve(engine: Engine, tokenizer: Tokenizer, config: RuntimeConfig) -> int:
    import uvicorn

    from tp_runtime.cli import API_KEY_ENV
    from tp_runtime.http import ServerSettings, create_app

    settings = ServerSettings(
        served_model_names(config),
        model_path=config.model,
        api_key=os.environ.get(API_KEY_ENV) or None,
        require_api_key_for_metrics=config.require_api_key_for_metrics,
        bind_host=config.host,
        max_request_body_size=config.max_request_body_size,
        max_prompt_chars=config.max_prompt_chars,
        request_body_timeout_s=config.request_body_timeout,
    )
    app = create_app(engine, tokenizer, settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=config.host, port=config.port, log_level=config.log_level, lifespan="off",
            timeout_keep_alive=config.timeout_keep_alive,
        )
    )
    # uvicorn in a non-main thread installs no signal handlers: the main thread owns SIGTERM (drain)
    # and PARENT_DIED (fail fast).
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    stop = threading.Event()

    def drain(signum: int, _frame: object) -> None:
        log.info("SIGTERM: draining (up to %.0f s)", DRAIN_TIMEOUT_S)
        threading.Thread(target=lambda: (engine.drain(DRAIN_TIMEOUT_S), stop.set()), daemon=True).start()

    def parent_died(signum: int, _frame: object) -> None:
        engine.fail("rank 0 exited: the runtime is down")
        stop.set()

    signal.signal(signal.SIGTERM, drain)
    signal.signal(PARENT_DIED, parent_died)
    signal.signal(signal.SIGINT, drain)
    thread.start()
    log.info("serving %s on http://%s:%d", engine.model_name, config.host, config.port)
    while not stop.wait(0.2):
        if engine.failed:
            log.error("runtime failed: %s", engine.health().reason)
            stop.wait(FAILED_LINGER_S)
            break
    server.should_exit = True
    thread.join(timeout=5)
    return 1 if engine.failed else 0


if __name__ == "__main__":
    sys.exit(main())
