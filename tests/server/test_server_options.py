"""The serve command's HTTP options, from the command line to the app's settings."""

from __future__ import annotations

import os

import pytest

from tp_runtime import cli, frontend
from tp_runtime.cli import checks
from tp_runtime.config import ConfigError, RuntimeConfig


def config_of(*argv: str) -> RuntimeConfig:
    return cli.config_from_args(cli.build_parser().parse_args(["serve", "--model", "/m/model.gguf", *argv]))


def test_http_options_reach_the_config():
    config = config_of(
        "--served-model-name", "first", "second", "--max-num-queued-reqs", "9", "--max-request-body-size", "2MiB",
        "--max-prompt-chars", "1000", "--request-body-timeout", "2.5", "--timeout-keep-alive", "7",
        "--require-api-key-for-metrics",
    )
    assert config.served_model_name == ("first", "second")
    assert (config.max_num_queued_reqs, config.max_request_body_size, config.max_prompt_chars) == (9, 2 << 20, 1000)
    assert (config.request_body_timeout, config.timeout_keep_alive, config.require_api_key_for_metrics) == (2.5, 7, True)
    again = RuntimeConfig.from_json(config.to_json())
    assert frontend.served_model_names(again) == ("first", "second")


def test_the_model_id_defaults_to_the_model_path_as_vllm_reports_it():
    assert frontend.served_model_names(config_of()) == ("/m/model.gguf",)


def test_the_api_key_leaves_the_command_line_for_the_environment(monkeypatch):
    # setenv first, so that the variable _hide_api_key sets is undone after the test.
    monkeypatch.setenv(cli.API_KEY_ENV, "")
    monkeypatch.delenv(cli.API_KEY_ENV)
    argv = ["serve", "--api-key", "k1", "--port", "9000"]
    assert cli._hide_api_key(cli.build_parser().parse_args(argv), argv) == ["serve", "--port", "9000"]
    assert os.environ[cli.API_KEY_ENV] == "k1"
    argv = ["serve", "--api-key=k2"]
    assert cli._hide_api_key(cli.build_parser().parse_args(argv), argv) == ["serve"]
    assert os.environ[cli.API_KEY_ENV] == "k2"
    # Without the flag, VLLM_API_KEY as the user set it stands.
    assert cli._hide_api_key(cli.build_parser().parse_args(["serve"]), ["serve"]) == ["serve"]
    assert os.environ[cli.API_KEY_ENV] == "k2"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (("--served-model-name", "a", "a"), "--served-model-name"),
        (("--served-model-name", ""), "--served-model-name"),
        (("--max-num-queued-reqs", "-1"), "--max-num-queued-reqs"),
        (("--max-prompt-chars", "-5"), "--max-prompt-chars"),
        (("--request-body-timeout", "0"), "--request-body-timeout"),
        (("--timeout-keep-alive", "0"), "--timeout-keep-alive"),
    ],
)
def test_bad_http_options_are_one_sentence(argv, fragment):
    with pytest.raises(ConfigError, match=fragment):
        checks._check_http_options(config_of(*argv))


def test_the_engine_bounds_requests_in_flight_by_default():
    from protocol.auth import new_key
    from protocol.transport import SchedulerEndpoint, ipc_address
    from scheduler.request import SamplingParams
    from server.fake_engine import default_model_path
    from tp_runtime.engine import EngineOverloaded
    from tp_runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(default_model_path())
    endpoint = SchedulerEndpoint(ipc_address(), new_key(), "options-test")
    config = RuntimeConfig(
        model="/m/x.gguf", num_kv_pages=64, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_scheduler_steps=16
    )
    try:
        for bound, settings in ((8 * 4, config), (5, RuntimeConfig(**{**config.__dict__, "max_num_queued_reqs": 5}))):
            engine = frontend.build_engine(settings, endpoint, tokenizer)  # not started: every submit waits
            for _ in range(bound):
                engine.submit([1, 2], SamplingParams(max_tokens=2))
            with pytest.raises(EngineOverloaded):
                engine.submit([1, 2], SamplingParams(max_tokens=2))
    finally:
        endpoint.close()
