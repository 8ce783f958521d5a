"""The runtime on an older torch than CI's: the GPU machine's image has torch 2.11, whose torchrun
lacks options that CI's torch has. Checked on the CPU against parsers built from torch's own."""

from __future__ import annotations

import argparse

import pytest

from tp_runtime import launcher as launch
from tp_runtime import torch_floor
from tp_runtime.config import ConfigError, RuntimeConfig

# What torch 2.11's torchrun does not have: it came with pytorch#172596 (March 2026).
NEWER_THAN_2_11 = ("--shutdown-timeout", "--shutdown_timeout")


def parser_without(*options: str) -> argparse.ArgumentParser:
    """torch's own torchrun parser, less the actions that answer to any of `options`."""
    from torch.distributed.run import get_args_parser

    full = get_args_parser()
    older = argparse.ArgumentParser(prog="torchrun")
    for action in full._actions:
        if action.option_strings and not set(action.option_strings) & set(options) and "-h" not in action.option_strings:
            older._add_action(action)
        elif not action.option_strings:
            older._add_action(action)  # the script and its arguments
    return older


def argv_for(parser: argparse.ArgumentParser, config: RuntimeConfig) -> list[str]:
    return launch.torchrun_argv(config, "127.0.0.1:29500", "127.0.0.1", ["serve", "--port", "1"], launch.torchrun_options(parser))


def test_every_option_the_launcher_passes_is_one_this_torchrun_parses() -> None:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    supported = launch.torchrun_options(parser)
    config = RuntimeConfig(model="m", shutdown_timeout=45)
    argv = argv_for(parser, config)
    passed = [arg.split("=", 1)[0] for arg in argv[: argv.index("-m")]]
    assert passed == [flag.name for flag in launch.torchrun_flags(config, "e", "a") if flag.name in supported]
    args = parser.parse_args(argv)
    assert args.module and args.training_script == "tp_runtime" and args.training_script_args == ["serve", "--port", "1"]
    assert args.rdzv_endpoint == "127.0.0.1:29500" and args.local_addr == "127.0.0.1" and args.max_restarts == 0


def test_on_a_torchrun_without_the_newer_options_the_launcher_passes_only_what_it_has() -> None:
    older = parser_without(*NEWER_THAN_2_11)
    with pytest.raises(SystemExit):  # the failure this guards against: argparse ends the launch
        older.parse_args(["--shutdown-timeout=40", "-m", "tp_runtime"])
    config = RuntimeConfig(model="m", shutdown_timeout=45)
    argv = argv_for(older, config)
    assert not any(arg.startswith(NEWER_THAN_2_11) for arg in argv)
    args = older.parse_args(argv)  # no SystemExit
    assert args.signals_to_handle == "SIGINT,SIGHUP,SIGQUIT" and args.training_script_args[0] == "serve"
    assert args.max_restarts == 0 and args.nproc_per_node == "1"


@pytest.mark.parametrize("lacking", ["--local-addr", "--signals-to-handle", "--rdzv-conf"])
def test_a_torchrun_without_an_option_the_launch_needs_is_refused_in_a_sentence(lacking: str) -> None:
    older = parser_without(lacking, lacking.replace("-", "_").replace("__", "--"))
    with pytest.raises(ConfigError, match=f"torchrun has no {lacking}: tp-runtime needs torch 2.11 or newer"):
        argv_for(older, RuntimeConfig(model="m"))


def test_the_torch_floor_refuses_an_older_torch_and_reads_every_kind_of_version() -> None:
    assert torch_floor.release("2.11.0+cu130") == (2, 11)
    assert torch_floor.release("2.12.0a0+git5f3e1b") == (2, 12)
    torch_floor.check_torch("2.11.0+cu130")
    torch_floor.check_torch("3.0.0")
    with pytest.raises(ConfigError, match=r"torch 2\.10\.1 is installed; tp-runtime needs torch 2\.11 or newer"):
        torch_floor.check_torch("2.10.1")
    with pytest.raises(ConfigError, match="cannot read torch's version"):
        torch_floor.check_torch("nightly")
    torch_floor.require_torch()  # CI's own torch


def test_pyproject_states_the_same_floor() -> None:
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert f"torch>={torch_floor.MIN_TORCH_TEXT}" in project["dependencies"]
