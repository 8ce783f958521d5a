"""Everything about a launch that can be checked before a rank starts: one sentence (ConfigError) each."""

from __future__ import annotations

import argparse
import errno
import importlib.util
import logging
import os
import socket

from protocol.frames import MAX_DECODE_STEPS, max_decode_steps
from protocol.sampling_limits import TOP_LOGPROBS_MAX
from tp_runtime.config import ConfigError, RuntimeConfig

log = logging.getLogger("tp_runtime.cli")

# --quantization values this runtime runs: a GGUF file's own block quantization (--weight-format
# says how it is kept), or none.
QUANTIZATIONS = ("gguf", "none")
TOOL_CALL_PARSERS = ("hermes",)


def validate(config: RuntimeConfig, args: argparse.Namespace) -> RuntimeConfig:
    """Everything that can be checked before a rank starts; raises ConfigError with one sentence."""
    from executor.errors import ModelLoadError
    from tp_runtime.resolve import resolve

    if config.tensor_parallel_size < 1:
        raise ConfigError("--tensor-parallel-size must be at least 1")
    if config.page_size < 1 or config.page_size & (config.page_size - 1):
        raise ConfigError(f"--page-size must be a power of two, got {config.page_size}")
    most_steps = max_decode_steps(config.page_size)
    if not 0 <= config.num_scheduler_steps <= most_steps:
        raise ConfigError(
            f"--num-scheduler-steps must be 1 to {most_steps} (at most --page-size and {MAX_DECODE_STEPS}; 0: the "
            f"default), got {config.num_scheduler_steps}"
        )
    if not os.path.exists(config.model):
        raise ConfigError(f"the model path {config.model} does not exist")
    _check_hosts(config)
    if config.device == "cuda":
        import torch

        if torch.cuda.device_count() < config.ranks_per_node:
            raise ConfigError(
                f"{config.ranks_per_node} ranks on this host need that many GPUs; it has {torch.cuda.device_count()}"
            )
    if args.command == "generate":
        if args.max_tokens < 1:
            raise ConfigError("--max-tokens must be at least 1")
        if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
            raise ConfigError("--temperature must be >= 0, --top-p in (0, 1] and --top-k >= 0")
    for note in check_vllm_flags(config, args):
        log.warning("tp-runtime: note: %s", note)
    if args.command == "serve":
        if not 0 <= config.shutdown_timeout < 3600:
            raise ConfigError(f"--shutdown-timeout must be in 0..3600 seconds, got {config.shutdown_timeout}")
        # Under the launcher (this check's caller) node 0 runs the HTTP server; the other hosts serve
        # none, and a host that rejoins may share a machine with node 0 (tests/e2e/test_multinode.py).
        if config.node_rank == 0:
            check_port_free(config.host, config.port)
        _check_http_options(config)
        if config.max_restarts < 0 or config.restart_window <= 0 or config.recovery_timeout <= 0:
            raise ConfigError("--max-restarts must be at least 0, --restart-window and --recovery-timeout above 0")
    if config.deterministic:
        from tp_runtime.resolve import uses_cuda

        if uses_cuda(config):
            raise ConfigError("--deterministic runs on the CPU only (its kernels are the CPU's): add --device cpu")
    try:
        resolved = resolve(config)
        _check_kv_scales(resolved)
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None
    return resolved


def check_vllm_flags(config: RuntimeConfig, args: argparse.Namespace) -> list[str]:
    """vLLM's flags: refuses those that cannot apply here (a sentence that says why and what to use),
    and returns one note for each accepted flag that changes nothing here, for the launcher to log."""
    if args.pipeline_parallel_size != 1:
        raise ConfigError(
            f"--pipeline-parallel-size {args.pipeline_parallel_size}: this runtime splits a model across devices "
            "by tensor parallelism only; use --tensor-parallel-size N (across hosts with --nnodes)"
        )
    quantization = (args.quantization or "none").lower()
    if quantization not in QUANTIZATIONS:
        raise ConfigError(
            f"--quantization {args.quantization}: this runtime does not load {args.quantization} checkpoints; it runs "
            "GGUF files (their 4-bit matrices kept as they are with --weight-format int4 or mixed) and dense "
            "safetensors in --dtype: convert the model to GGUF, or leave --quantization out"
        )
    if quantization == "gguf" and not config.model.endswith(".gguf"):
        raise ConfigError(f"--quantization gguf needs a .gguf model file, and {config.model} is not one")
    if args.kv_cache_memory is not None and args.gpu_memory_utilization is not None:
        raise ConfigError("pass --kv-cache-memory or --gpu-memory-utilization, not both: each sizes the KV pool")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if not 0 <= config.max_logprobs <= TOP_LOGPROBS_MAX:
        raise ConfigError(
            f"--max-logprobs must be in 0..{TOP_LOGPROBS_MAX} (the most alternatives the wire carries), got "
            f"{config.max_logprobs}"
        )
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ConfigError(
            f"--tool-call-parser {args.tool_call_parser}: tool calls are parsed in the Hermes format "
            "(<tool_call>{...}</tool_call>) only; pass --tool-call-parser hermes, or leave it out"
        )
    if config.tokenizer and not os.path.exists(config.tokenizer):
        raise ConfigError(f"the tokenizer path {config.tokenizer} does not exist (a .gguf file or a directory with tokenizer.json)")
    if config.chat_template:
        _check_chat_template(config.chat_template)
    notes = []
    for flag, given, why in (
        ("--trust-remote-code", args.trust_remote_code, "no code from model files runs here"),
        ("--disable-log-requests", args.disable_log_requests, "requests are not logged here"),
        ("--enable-auto-tool-choice", args.enable_auto_tool_choice, "tool_choice auto is always on here"),
        ("--tool-call-parser", args.tool_call_parser is not None, "the Hermes format is the one parsed"),
        ("--quantization", quantization == "gguf", "a GGUF file's quantization is read from the file"),
    ):
        if given:
            notes.append(f"{flag} is accepted and changes nothing: {why}")
    if config.gpu_memory_utilization and config.device != "cuda" and not _cuda_available(config):
        notes.append(
            f"--gpu-memory-utilization {config.gpu_memory_utilization} on the CPU: the KV pool gets that share of "
            f"this host's memory, split among its {config.ranks_per_node} ranks, less each rank's weights and activations"
        )
    return notes


def _cuda_available(config: RuntimeConfig) -> bool:
    from tp_runtime.resolve import uses_cuda

    return uses_cuda(config)


def _check_chat_template(template: str) -> None:
    from tp_runtime.chat import ChatTemplateError, load_chat_template

    try:
        load_chat_template(template)
    except ChatTemplateError as exc:
        raise ConfigError(f"--chat-template: {exc}") from None


def _check_kv_scales(config: RuntimeConfig) -> None:
    """--kv-cache-scales names a source that exists, for an fp8 cache (with another one it would do nothing)."""
    from executor.kv_scales import KVScaleError, checkpoint_scales, parse_scales_option, resolve_scales
    from tp_runtime.resolve import read_model_config

    try:
        option = parse_scales_option(config.kv_cache_scales)
        if config.resolved_kv_dtype != "fp8-e4m3":
            if config.kv_cache_scales != "auto":
                raise ConfigError(
                    f"--kv-cache-scales {config.kv_cache_scales} (or --calculate-kv-scales) applies to an fp8 KV "
                    f"cache; this one is {config.resolved_kv_dtype} (add --kv-cache-dtype fp8)"
                )
            return
        if option in ("auto", "checkpoint"):
            num_layers = read_model_config(config).num_layers
            resolve_scales(option, checkpoint_scales(config.model, num_layers), num_layers)
    except KVScaleError as exc:
        raise ConfigError(str(exc)) from None


def _check_hosts(config: RuntimeConfig) -> None:
    from tp_runtime import frame_keys, hosts

    if config.nnodes < 1 or not 0 <= config.node_rank < config.nnodes:
        raise ConfigError(f"--node-rank must be in 0..{max(config.nnodes, 1) - 1} and --nnodes at least 1")
    ranks = config.ranks_per_node * config.nnodes
    if config.nproc_per_node < 0 or config.ranks_per_node < 1 or ranks != config.tensor_parallel_size:
        raise ConfigError(
            f"--tensor-parallel-size {config.tensor_parallel_size} must equal --nnodes {config.nnodes} times "
            f"--nproc-per-node ({config.nproc_per_node or 'its default'})"
        )
    for flag, port, low in (("--master-port", config.master_port, 1), ("--frame-port", config.frame_port, 0)):
        if not low <= port < 65536:
            raise ConfigError(f"{flag} must be in {low}..65535, got {port}")
    if config.frame_key_dir and config.trust_rendezvous_store:
        raise ConfigError("pass --frame-key-dir or --trust-rendezvous-store, not both")
    if not config.multi_node:
        return
    if not (config.frame_key_dir or config.trust_rendezvous_store):
        raise ConfigError(
            "across hosts the frames are encrypted with keys the operator provides: make them with "
            "`tp-runtime keys DIR`, copy DIR to every host and pass --frame-key-dir DIR (or pass "
            "--trust-rendezvous-store; docs/deployment.md says what each trusts)"
        )
    if config.frame_key_dir:
        frame_keys.load_key_dir(config.frame_key_dir)
    elif importlib.util.find_spec("cryptography") is None:
        raise ConfigError("--trust-rendezvous-store needs the `cryptography` package: pip install 'tp-runtime[multinode]'")
    hosts.resolve(config.master_addr)
    if config.advertise_host:
        hosts.resolve(config.advertise_host)


def _check_http_options(config: RuntimeConfig) -> None:
    names = config.served_model_name
    if any(not name for name in names) or len(set(names)) != len(names):
        raise ConfigError(f"--served-model-name takes distinct, non-empty names, got {list(names)}")
    for flag, value in (
        ("--max-num-queued-reqs", config.max_num_queued_reqs),
        ("--max-request-body-size", config.max_request_body_size),
        ("--max-prompt-chars", config.max_prompt_chars),
    ):
        if value < 0:
            raise ConfigError(f"{flag} must be at least 1, or 0 for its default; got {value}")
    if config.frontend_nice is not None and not 0 <= config.frontend_nice <= 19:
        raise ConfigError(f"--frontend-nice takes 0 to 19 (a lower priority than the ranks'), got {config.frontend_nice}")
    if not config.request_body_timeout > 0 or not config.request_header_timeout > 0 or config.timeout_keep_alive < 1:
        raise ConfigError(
            "--request-body-timeout and --request-header-timeout must be positive and --timeout-keep-alive at least 1 second"
        )


def check_port_free(host: str, port: int) -> None:
    """Refuses a port uvicorn could not listen on; one that only lingers in TIME_WAIT is free."""
    from tp_runtime.hosts import check_can_listen

    if not 0 < port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {port}")
    try:
        check_can_listen(host, port)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is already in use") from None
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
