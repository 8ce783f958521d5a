"""The `tp-runtime` command's options: vLLM's flag names and spellings, and the RuntimeConfig they make.

argparse's own usage errors get one sentence on stderr and exit code 2, as every bad option does.
"""

from __future__ import annotations

import argparse
import os
import sys

from executor.options import WEIGHT_FORMATS
from tp_runtime.config import (
    DTYPE_ALIASES,
    DTYPES,
    KV_DTYPE_ALIASES,
    KV_DTYPES,
    ConfigError,
    RuntimeConfig,
    parse_size,
)

EXIT_USAGE = 2
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's: the server's API key when --api-key is not given
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"  # vLLM's switch of its batch-invariant mode: 1 or 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own usage errors: one sentence, exit 2
        sys.stderr.write(f"tp-runtime: error: {message}\n")
        raise SystemExit(EXIT_USAGE)


def _add_runtime_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and parallelism")
    g.add_argument("--model", help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="number of ranks (default 1)")
    g.add_argument(
        "--dtype", type=_dtype, default="auto", metavar="{" + ",".join((*DTYPES, *DTYPE_ALIASES)) + "}",
        help="weights and activations (auto: bf16 where the hardware computes in it, else fp32; vLLM's names too)",
    )
    g.add_argument(
        "--weight-format", choices=WEIGHT_FORMATS, default="auto",
        help="dense: all weights in --dtype; int4: a GGUF's 4-bit matrices stay 4-bit (least memory); mixed: both, "
        "int4 for steps of up to 8 tokens (fastest); auto: mixed on CPUs with bf16/fp16 activations, else dense",
    )
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument(
        "--pipelined-readback", action=argparse.BooleanOptionalAction, default=None,
        help="queue each forward before the step before's sample is read back, so that the GPU does not wait on "
        "the host between two forwards (default: on CUDA; the CPU's forwards are synchronous)",
    )
    g.add_argument(
        "--deterministic", action=argparse.BooleanOptionalAction, default=None,
        help="each request's tokens and logprobs bitwise the same whatever its batch, chunking, schedule or TP size "
        f"(CPU; docs/invariance.md); default ${BATCH_INVARIANT_ENV} (vLLM's spelling), else off",
    )
    g = p.add_argument_group("KV cache and batching")
    g.add_argument(
        "--kv-cache-dtype", type=_kv_cache_dtype, default="auto", metavar="{" + ",".join(KV_DTYPES) + "}",
        help="KV cache storage (vLLM's fp8 and fp8_e4m3 mean fp8-e4m3; auto: the model's --dtype)",
    )
    g.add_argument(
        "--kv-cache-scales", default="auto", metavar="{auto,checkpoint,calibrate,NUMBER}",
        help="fp8 KV scales per layer: auto (the checkpoint's k_scale/v_scale, else calibrated on the first "
        "prefill), checkpoint (required), calibrate, or one number for every layer (1.0: vLLM's uncalibrated)",
    )
    g.add_argument(
        "--calculate-kv-scales", action="store_true",
        help="vLLM's spelling of --kv-cache-scales calibrate",
    )
    g.add_argument("--page-size", "--block-size", dest="page_size", type=int, default=16)
    g.add_argument("--num-kv-pages", type=int, default=0, help="pages in the KV pool (default: from --kv-cache-memory)")
    g.add_argument(
        "--kv-cache-memory", type=parse_size, default=None,
        help="KV pool size per rank (default 1GiB, unless --gpu-memory-utilization)",
    )
    g.add_argument(
        "--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
        help="vLLM's: the share of the GPU's total memory one rank may use for weights, activations and the KV "
        "pool together, the pool getting what is left; on the CPU, the share of the host's memory, split among "
        "the ranks on the host (default: --kv-cache-memory sizes the pool)",
    )
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-model-len", type=int, default=0, help="default: the model's context length")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    g.add_argument("--swap-space", type=parse_size, default=0, help="host buffer for preempted pages (0: recompute)")
    g.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="share the KV pages of common prompt prefixes (default on)",
    )
    g.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
        help="plan and stage step N+1 while step N runs (default on; --no-async-scheduling runs steps in series)",
    )
    g.add_argument(
        "--num-scheduler-steps", type=int, default=0, metavar="N",
        help="vLLM's: forwards a steady decode step runs on one frame, up to the page size and 32; while every "
        "request decodes and none waits, the control plane's work is paid once per N tokens and streams get up to "
        "N tokens per chunk; an arrival cuts the frame after the forward running (default 16, at most the page "
        "size; 1: a frame per forward)",
    )
    g.add_argument(
        "--frontend-nice", type=int, default=None, metavar="N",
        help="nice value of the frontend process (scheduler, HTTP); default 10 on the CPU, where it shares "
        "the cores with the forward, 0 on CUDA",
    )
    g = p.add_argument_group("fault injection (debug)")
    g.add_argument("--debug-poison-kv-cache", action="store_true", help="fill the cache with 0xFF (NaN) at allocation")
    g.add_argument("--debug-poison-freed-pages", action="store_true", help="fill every page freed to the pool with 0xFF")
    g.add_argument("--debug-skip-clears", action="store_true", help="skip clearing pages (proves the poison is detected)")
    g = p.add_argument_group("across hosts (torchrun's names; docs/deployment.md)")
    g.add_argument("--nnodes", type=int, default=1, help="hosts in the launch; run the same command on each")
    g.add_argument("--node-rank", type=int, default=0, help="this host's number, 0..nnodes-1; host 0 holds the rendezvous")
    g.add_argument("--nproc-per-node", type=int, default=0, help="ranks on this host (default: --tensor-parallel-size / --nnodes)")
    g.add_argument("--master-addr", default="127.0.0.1", help="address of host 0, where torchrun's c10d rendezvous listens")
    g.add_argument("--master-port", type=int, default=29500, help="port of the rendezvous on host 0 (default 29500)")
    g.add_argument("--advertise-host", default="", help="address the other hosts reach the scheduler by (default: the interface of the rendezvous)")
    g.add_argument("--frame-port", type=int, default=0, help="the scheduler's tcp port across hosts (default: any free port)")
    g.add_argument("--frame-key-dir", default="", help="keys made by `tp-runtime keys DIR` and copied to every host (0700)")
    g.add_argument(
        "--trust-rendezvous-store", action="store_true",
        help="make keys per launch and pass their public halves through torchrun's rendezvous store, trusting it",
    )
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning")
    _add_vllm_options(p)


# vLLM's --uvicorn-log-level choices; "trace" is uvicorn's own, below debug.
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _add_vllm_options(p: argparse.ArgumentParser) -> None:
    """vLLM's flags that have a meaning of their own here, or none: tp_runtime/cli/checks.py logs the
    ones that change nothing and refuses the ones that cannot apply, saying what to use instead."""
    g = p.add_argument_group("vLLM's other flags (docs/http_api.md: which change what here)")
    g.add_argument("--tokenizer", default="", help="a GGUF file or a directory with tokenizer.json (default: the model's)")
    g.add_argument(
        "--chat-template", default="",
        help="a Jinja chat template, or a file holding one, in place of the tokenizer's",
    )
    g.add_argument("--max-logprobs", type=int, default=20, help="most alternatives per token a request may ask for (default 20)")
    g.add_argument("--quantization", "-q", default=None, help="gguf (a GGUF file's own quantization) or none")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="1: only tensor parallelism is run")
    g.add_argument("--trust-remote-code", action="store_true", help="accepted; no code from model files runs here")
    g.add_argument("--disable-log-requests", action="store_true", help="accepted; requests are not logged here")
    g.add_argument("--enable-auto-tool-choice", action="store_true", help="accepted; tool_choice auto is always on")
    g.add_argument("--tool-call-parser", default=None, help="hermes (the only format parsed; docs/http_api.md)")


def _add_http_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP server (docs/http_api.md)")
    g.add_argument("--api-key", help=f"require 'Authorization: Bearer <key>' on /v1 and /generate (default: ${API_KEY_ENV})")
    g.add_argument("--require-api-key-for-metrics", action="store_true", help="/metrics needs the key too")
    g.add_argument(
        "--served-model-name", nargs="+", default=(), metavar="NAME",
        help="names requests may give as `model`; answers report the first (default: the --model path)",
    )
    g.add_argument(
        "--max-num-queued-reqs", type=int, default=0,
        help="requests in flight (waiting + running) before new ones get 429 (default: 8 x --max-num-seqs)",
    )
    g.add_argument("--max-request-body-size", type=parse_size, default=0, help="largest request body (default: from --max-prompt-chars)")
    g.add_argument("--max-prompt-chars", type=int, default=0, help="longest prompt text (default: --max-model-len x the longest token)")
    g.add_argument("--request-body-timeout", type=float, default=30.0, help="seconds a request body may take to arrive (default 30)")
    g.add_argument(
        "--request-header-timeout", type=float, default=10.0,
        help="seconds a request's line and headers may take to arrive; slower connections are closed (default 10)",
    )
    g.add_argument("--timeout-keep-alive", type=int, default=5, help="seconds an idle connection stays open (default 5)")


def _add_recovery_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("recovery of a failed executor group (docs/deployment.md)")
    g.add_argument(
        "--max-restarts", type=int, default=3,
        help="executor group restarts allowed within --restart-window; one more ends the service (default 3; 0: a failed rank ends it)",
    )
    g.add_argument("--restart-window", type=float, default=600.0, help="seconds over which restarts are counted (default 600)")
    g.add_argument(
        "--recovery-timeout", type=float, default=60.0,
        help="seconds requests wait for a restarting executor group before 503 with Retry-After (default 60)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tp-runtime", description="Tensor-parallel LLM inference that never reads unwritten KV bytes.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    serve = sub.add_parser("serve", help="run the HTTP server")
    _add_runtime_options(serve)
    serve.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it (the same as --model)",
    )
    serve.add_argument("--seed", type=int, default=None, help="seeds the sampling of requests that bring no seed")
    serve.add_argument(
        "--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default=None, help="the HTTP server's log level (default: --log-level)"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--shutdown-timeout", type=float, default=20.0,
        help="on SIGTERM, seconds running requests may take to finish (default 20; torchrun's grace period is 30)",
    )
    _add_http_options(serve)
    _add_recovery_options(serve)
    gen = sub.add_parser("generate", help="generate a completion of one prompt and exit")
    gen.add_argument("prompt")
    _add_runtime_options(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stream", action="store_true", help="print the text as it is generated")
    gen.add_argument("--raw", action="store_true", help="do not wrap the prompt in the model's chat template")
    keys = sub.add_parser("keys", help="make the key directories --frame-key-dir names, one per host")
    keys.add_argument("directory", help="a directory that does not exist yet; OUT/<host> is for that host")
    keys.add_argument("--hosts", nargs="+", required=True, help="a name for each host (the directories' names)")
    sub.add_parser("soak", help="soak run under KV pressure with fault injection (scripts/soak.py)", add_help=False)
    sub.add_parser("bench", help="serving benchmark (scripts/bench_serving.py)", add_help=False)
    return parser


def config_from_args(args: argparse.Namespace) -> RuntimeConfig:
    from executor.default_model import default_model_path

    return RuntimeConfig(
        model=_model(args) or default_model_path(),
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        weight_format=args.weight_format,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_scales=_kv_cache_scales(args),
        page_size=args.page_size,
        num_kv_pages=args.num_kv_pages,
        kv_cache_memory=parse_size("1GiB") if args.kv_cache_memory is None else args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization or 0.0,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        swap_space=args.swap_space,
        enable_prefix_caching=args.enable_prefix_caching,
        async_scheduling=args.async_scheduling,
        num_scheduler_steps=args.num_scheduler_steps,
        frontend_nice=getattr(args, "frontend_nice", None),
        device=args.device,
        enforce_eager=args.enforce_eager,
        pipelined_readback=args.pipelined_readback,
        deterministic=_deterministic(args),
        host=getattr(args, "host", "127.0.0.1"),
        port=getattr(args, "port", 8000),
        debug_poison_kv_cache=args.debug_poison_kv_cache,
        debug_poison_freed_pages=args.debug_poison_freed_pages,
        debug_skip_clears=args.debug_skip_clears,
        log_level=args.log_level,
        seed=args.seed if args.command == "serve" else None,  # generate's --seed is its request's
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        uvicorn_log_level=getattr(args, "uvicorn_log_level", None) or "",
        max_logprobs=args.max_logprobs,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        nproc_per_node=args.nproc_per_node,
        master_addr=args.master_addr,
        master_port=args.master_port,
        advertise_host=args.advertise_host,
        frame_port=args.frame_port,
        frame_key_dir=args.frame_key_dir,
        trust_rendezvous_store=args.trust_rendezvous_store,
        shutdown_timeout=getattr(args, "shutdown_timeout", 20.0),
        max_restarts=getattr(args, "max_restarts", 3),
        restart_window=getattr(args, "restart_window", 600.0),
        recovery_timeout=getattr(args, "recovery_timeout", 60.0),
        served_model_name=tuple(getattr(args, "served_model_name", ())),
        max_num_queued_reqs=getattr(args, "max_num_queued_reqs", 0),
        max_request_body_size=getattr(args, "max_request_body_size", 0),
        max_prompt_chars=getattr(args, "max_prompt_chars", 0),
        request_body_timeout=getattr(args, "request_body_timeout", 30.0),
        request_header_timeout=getattr(args, "request_header_timeout", 10.0),
        timeout_keep_alive=getattr(args, "timeout_keep_alive", 5),
        require_api_key_for_metrics=getattr(args, "require_api_key_for_metrics", False),
    )


def _model(args: argparse.Namespace) -> str | None:
    """--model, or the positional MODEL of `serve` (vLLM's `vllm serve MODEL`); both must agree."""
    tag = getattr(args, "model_tag", None)
    if tag and args.model and tag != args.model:
        raise ConfigError(f"the model is given twice, as {tag} and as --model {args.model}: give it once")
    return tag or args.model


def _dtype(text: str) -> str:
    """--dtype: ours, or vLLM's names (float32, bfloat16, half, float16, float)."""
    name = DTYPE_ALIASES.get(text, text)
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"invalid choice {text!r}; choose from {', '.join((*DTYPES, *DTYPE_ALIASES))}")
    return name


def _kv_cache_dtype(text: str) -> str:
    """--kv-cache-dtype: ours, or vLLM's names for the same storage."""
    name = KV_DTYPE_ALIASES.get(text, text)
    if name not in KV_DTYPES:
        unsupported = " (only e4m3 fp8 is supported: use fp8)" if text.startswith("fp8") else ""
        raise argparse.ArgumentTypeError(
            f"invalid choice {text!r}{unsupported}; choose from {', '.join((*KV_DTYPES, *KV_DTYPE_ALIASES))}"
        )
    return name


def _deterministic(args: argparse.Namespace) -> bool:
    """--deterministic / --no-deterministic, else vLLM's VLLM_BATCH_INVARIANT=1 (or 0), else off."""
    if args.deterministic is not None:
        return args.deterministic
    value = os.environ.get(BATCH_INVARIANT_ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise ConfigError(f"{BATCH_INVARIANT_ENV} must be 1 or 0, got {value!r}")
    return value == "1"


def _kv_cache_scales(args: argparse.Namespace) -> str:
    if args.calculate_kv_scales:
        if args.kv_cache_scales not in ("auto", "calibrate"):
            raise ConfigError(f"--calculate-kv-scales contradicts --kv-cache-scales {args.kv_cache_scales}")
        return "calibrate"
    return args.kv_cache_scales
