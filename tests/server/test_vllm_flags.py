"""vLLM's command lines, as its documentation writes them, parse here with vLLM's meaning; flags that
change nothing are accepted with a note, flags that cannot apply are refused with a sentence."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from tp_runtime import cli
from tp_runtime.cli import checks
from tp_runtime.config import ConfigError, RuntimeConfig

MODEL = "/m/model.gguf"
# From vLLM's documentation (the OpenAI-compatible server, tool calling and engine-arguments pages),
# with the hub name replaced by a local file: nothing is downloaded here.
DOCS = {
    "openai_server": "vllm serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123",
    "tool_calling": "vllm serve NousResearch/Hermes-2-Pro-Llama-3-8B --enable-auto-tool-choice --tool-call-parser hermes",
    "memory": "vllm serve mistralai/Mistral-7B-v0.1 --gpu-memory-utilization 0.95 --max-model-len 8192",
    "many": (
        "vllm serve google/gemma-3-27b-it --gpu-memory-utilization 0.95 --max-model-len 16384 "
        "--enable-prefix-caching --kv-cache-dtype fp8 --max-num-batched-tokens 32768 --trust-remote-code "
        "--port 8055 --served-model-name subclaim-extractor --seed 0 --dtype bfloat16 --max-logprobs 5 "
        "--disable-log-requests --uvicorn-log-level warning -pp 1 --quantization gguf"
    ),
}


def parse(line: str) -> tuple[object, RuntimeConfig]:
    words = shlex.split(line)
    assert words[:2] == ["vllm", "serve"]
    argv = ["serve", MODEL, *words[3:]]
    args = cli.build_parser().parse_args(argv)
    return args, cli.config_from_args(args)


def test_the_openai_server_page(monkeypatch):
    monkeypatch.setenv(cli.API_KEY_ENV, "")
    args, config = parse(DOCS["openai_server"])
    assert config.model == MODEL and config.dtype == "auto"
    assert args.api_key == "token-abc123"


def test_the_tool_calling_page():
    args, config = parse(DOCS["tool_calling"])
    notes = checks.check_vllm_flags(config, args)
    assert any("--enable-auto-tool-choice" in n for n in notes) and any("--tool-call-parser" in n for n in notes)


def test_gpu_memory_utilization_and_the_rest():
    args, config = parse(DOCS["many"])
    assert config.gpu_memory_utilization == 0.95
    assert (config.max_model_len, config.kv_cache_dtype, config.max_num_batched_tokens) == (16384, "fp8-e4m3", 32768)
    assert (config.port, config.served_model_name, config.seed) == (8055, ("subclaim-extractor",), 0)
    assert (config.dtype, config.max_logprobs, config.uvicorn_log_level) == ("bf16", 5, "warning")
    assert config.enable_prefix_caching
    notes = checks.check_vllm_flags(config, args)
    for flag in ("--trust-remote-code", "--disable-log-requests", "--quantization"):
        assert sum(flag in n for n in notes) == 1, notes
    again = RuntimeConfig.from_json(config.to_json())
    assert (again.gpu_memory_utilization, again.seed, again.max_logprobs) == (0.95, 0, 5)


@pytest.mark.parametrize(
    "given, ours", [("float32", "fp32"), ("bfloat16", "bf16"), ("half", "fp16"), ("float16", "fp16"), ("fp32", "fp32")]
)
def test_dtype_names(given, ours):
    assert parse(f"vllm serve m --dtype {given}")[1].dtype == ours


def test_prefix_caching_both_ways():
    assert parse("vllm serve m --enable-prefix-caching")[1].enable_prefix_caching
    assert not parse("vllm serve m --no-enable-prefix-caching")[1].enable_prefix_caching


def test_the_model_positional_or_flag_but_not_two_different():
    args = cli.build_parser().parse_args(["serve", "--model", MODEL])
    assert cli.config_from_args(args).model == MODEL
    args = cli.build_parser().parse_args(["serve", MODEL, "--model", MODEL])
    assert cli.config_from_args(args).model == MODEL
    args = cli.build_parser().parse_args(["serve", MODEL, "--model", "/other.gguf"])
    with pytest.raises(ConfigError, match="given twice"):
        cli.config_from_args(args)


@pytest.mark.parametrize(
    "flags, fragment",
    [
        ("--pipeline-parallel-size 2", "--tensor-parallel-size"),
        ("--quantization awq", "convert the model to GGUF"),
        ("--tool-call-parser llama3_json", "hermes"),
        ("--max-logprobs 21", "--max-logprobs"),
        ("--gpu-memory-utilization 1.5", "(0, 1]"),
        ("--gpu-memory-utilization 0.5 --kv-cache-memory 1GiB", "not both"),
        ("--chat-template not-a-file-or-template", "neither a file nor a Jinja template"),
        ("--tokenizer /no/such/tokenizer", "does not exist"),
    ],
)
def test_flags_that_cannot_apply_are_refused_with_what_to_use(flags, fragment):
    args, config = parse(f"vllm serve m {flags}")
    with pytest.raises(ConfigError) as raised:
        checks.check_vllm_flags(config, args)
    assert fragment in str(raised.value)


def test_quantization_gguf_needs_a_gguf_file():
    args = cli.build_parser().parse_args(["serve", "/m/dir", "--quantization", "gguf"])
    with pytest.raises(ConfigError, match="needs a .gguf"):
        checks.check_vllm_flags(cli.config_from_args(args), args)


def test_chat_template_file_or_text(tmp_path: Path, tokenizer):
    from tp_runtime.chat import render_chat
    from tp_runtime.tokenizer import load_tokenizer

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    args, config = parse(f"vllm serve m --chat-template {path}")
    assert checks.check_vllm_flags(config, args) == []
    from executor.model import default_model_path

    loaded = load_tokenizer(default_model_path(), chat_template=str(path))
    assert render_chat(loaded, [{"role": "user", "content": "hi"}]) == "[user] hi\n"
    inline = load_tokenizer(default_model_path(), chat_template="{{ messages[0].content }}!")
    assert render_chat(inline, [{"role": "user", "content": "hi"}]) == "hi!"


def test_gpu_memory_utilization_leaves_the_rest_to_the_pool():
    from executor.model.config import ModelConfig
    from tp_runtime.memory_budget import activation_bytes, kv_cache_bytes, weight_bytes_per_rank

    model = ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, rope_theta=1e5, rope_scaling=None, rms_eps=1e-5, tie_embeddings=True,
        max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,),
    )
    # SmolLM2-135M: 134.5 M parameters, 513 MiB in fp32.
    assert abs(weight_bytes_per_rank(model, "fp32", 1) / 2**20 - 513) < 3
    gpu = RuntimeConfig(model="m", dtype="bf16", gpu_memory_utilization=0.5)
    total = 80 << 30
    kv = kv_cache_bytes(gpu, model, use_cuda=True, total=total)
    assert kv == total // 2 - weight_bytes_per_rank(model, "bf16", 1) - activation_bytes(model, "bf16", 512, 64)
    # On the CPU the host's memory is split among its ranks.
    cpu = RuntimeConfig(model="m", dtype="fp32", tensor_parallel_size=2, gpu_memory_utilization=0.5)
    assert kv_cache_bytes(cpu, model, use_cuda=False, total=total) < kv_cache_bytes(
        RuntimeConfig(model="m", dtype="fp32", gpu_memory_utilization=0.5), model, use_cuda=False, total=total
    ) // 2 + 1
    with pytest.raises(ConfigError, match="raise it"):
        kv_cache_bytes(RuntimeConfig(model="m", dtype="fp32", gpu_memory_utilization=0.01), model, False, total=1 << 30)


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        ("", None, False),
        ("--deterministic", None, True),
        ("", "1", True),
        ("", "0", False),
        ("--no-deterministic", "1", False),  # the flag wins over vLLM's environment switch
        ("--deterministic", "0", True),
    ],
)
def test_deterministic_flag_and_vllm_batch_invariant(monkeypatch, flags, env, expected):
    if env is None:
        monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    else:
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", env)
    _, config = parse(f"vllm serve m {flags}")
    assert config.deterministic is expected


def test_a_vllm_batch_invariant_value_other_than_0_or_1_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "yes")
    with pytest.raises(ConfigError, match="VLLM_BATCH_INVARIANT must be 1 or 0"):
        parse("vllm serve m")


@pytest.mark.parametrize(
    ("flags", "page_size", "expected"),
    [("", 16, 16), ("", 8, 8), ("--num-scheduler-steps 4", 16, 4), ("--num-scheduler-steps 1", 16, 1)],
)
def test_num_scheduler_steps_defaults_to_16_within_the_page_size(flags: str, page_size: int, expected: int) -> None:
    from executor.default_model import default_model_path
    from tp_runtime.resolve import resolve

    args = cli.build_parser().parse_args(["serve", default_model_path(), "--page-size", str(page_size), *flags.split()])
    assert resolve(cli.config_from_args(args)).num_scheduler_steps == expected


@pytest.mark.parametrize("value", ["-1", "17", "33"])
def test_num_scheduler_steps_past_the_page_size_is_refused_with_a_sentence(value: str) -> None:
    args, config = parse(f"vllm serve m --num-scheduler-steps {value}")
    with pytest.raises(ConfigError, match=r"--num-scheduler-steps must be 1 to 16 \(at most --page-size"):
        checks.validate(config, args)


@pytest.mark.parametrize(("flags", "expected"), [("", None), ("--pipelined-readback", True), ("--no-pipelined-readback", False)])
def test_pipelined_readback_reaches_the_executors(flags: str, expected: bool | None) -> None:
    # None: each executor decides by its device (on CUDA only: executor/steps.py).
    from executor.default_model import default_model_path
    from tp_runtime.resolve import executor_options, resolve

    config = resolve(cli.config_from_args(cli.build_parser().parse_args(["serve", default_model_path(), *flags.split()])))
    assert config.pipelined_readback is expected
    for use_cuda in (False, True):
        assert executor_options(config, use_cuda).pipelined_readback is expected
