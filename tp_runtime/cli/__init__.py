"""The `tp-runtime` command: serve, generate, keys, soak, bench.

Outside torchrun, `serve` and `generate` validate every option, then re-enter themselves through
torch.distributed's launcher; inside torchrun they become one rank. Options follow vLLM's names
(tp_runtime/cli/options.py); bad options get one sentence on stderr and exit code 2, before any
rank starts (tp_runtime/cli/checks.py). tp_runtime/cli/generate.py is `generate`'s frontend job.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from tp_runtime.cli.checks import check_port_free, validate
from tp_runtime.cli.generate import run_generate_job
from tp_runtime.cli.options import API_KEY_ENV, EXIT_USAGE, build_parser, config_from_args
from tp_runtime.config import ConfigError

__all__ = [
    "API_KEY_ENV",
    "EXIT_USAGE",
    "build_parser",
    "check_port_free",
    "config_from_args",
    "main",
    "run_generate_job",
    "validate",
]

TOOL_SCRIPTS = {"soak": "soak", "bench": "bench_serving"}


def _hide_api_key(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """Moves --api-key into the environment that every process of the launch inherits, and out of
    the argv handed on to them, so that the key shows in no command line but the one it was typed on."""
    if getattr(args, "api_key", None):
        os.environ[API_KEY_ENV] = args.api_key
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--api-key":
            skip = True
        elif not arg.startswith("--api-key="):
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOL_SCRIPTS:  # their options are the scripts' own, --help included
        from tp_runtime.tools import run_script

        return run_script(TOOL_SCRIPTS[argv[0]], argv[1:])
    args = build_parser().parse_args(argv)
    argv = _hide_api_key(args, argv)
    from tp_runtime.launcher import launch, quiet_torchrun, under_torchrun
    from tp_runtime.signal_watch import dump_stacks_on_signal
    from tp_runtime.worker_process import run_worker

    dump_stacks_on_signal()  # the launcher and the ranks (the frontend: tp_runtime/frontend.py)
    if args.command in ("serve", "generate") and not under_torchrun():
        quiet_torchrun(args.log_level)
    from executor.errors import ModelLoadError

    try:
        if args.command == "keys":
            from tp_runtime.frame_keys import create_key_dirs

            for host, directory in create_key_dirs(args.directory, args.hosts).items():
                sys.stdout.write(f"{host}: copy {directory} to that host and pass --frame-key-dir with its path\n")
            return 0
        config = config_from_args(args)
        if under_torchrun():
            return run_worker(config, args.command, argv)
        config = validate(config, args)
        return launch(config, argv)
    except (ConfigError, ModelLoadError) as exc:
        sys.stderr.write(f"tp-runtime: error: {exc}\n")
        return EXIT_USAGE
