"""Bad options get one clear sentence and exit code 2 before any rank starts.

Each refused command line runs through the CLI's `main` in this process: what a usage error is (exit
code 2, one sentence, no traceback) is decided there, and a new interpreter per case cost a second
or three each (torch imported for a model's checks). `python -m tp_runtime` around it, its exit code
and stderr, is run for real by test_missing_model_file."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.tiny_models import write_tiny_gguf, write_tiny_llama
from tp_runtime.cli import main
from tp_runtime.config import ConfigError


@dataclass(frozen=True)
class Result:
    returncode: int
    stderr: str


@pytest.fixture
def run_cli(capfd: pytest.CaptureFixture[str]) -> Iterator:
    """`tp-runtime ARGS` in this process: its exit code and everything written to fd 2. The
    environment is restored after each test: `main` sets torchrun's log variables (and would move
    an --api-key there) for the processes it would start."""
    saved = dict(os.environ)

    def run(*args: str) -> Result:
        capfd.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse's refusals exit; the interpreter would exit with the code
            code = exit.code
        return Result(code, capfd.readouterr().err)

    yield run
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny"), num_heads=4, num_kv_heads=2))


def assert_usage_error(result: Result | subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("tp-runtime: error: "), result.stderr
    for needle in needles:
        assert needle in message, message
    assert "Traceback" not in result.stderr


def test_missing_model_file() -> None:
    """The real command: its process exits 2 with the sentence last on its stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "tp_runtime", "generate", "hi", "--model", "/nonexistent/model.gguf"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert_usage_error(result, "/nonexistent/model.gguf", "does not exist")


def test_tensor_parallel_size_the_model_cannot_be_split_into(tiny: str, run_cli) -> None:
    assert_usage_error(run_cli("generate", "hi", "--model", tiny, "--tensor-parallel-size", "8"), "--tensor-parallel-size 8")


def test_port_in_use(tiny: str, run_cli) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert_usage_error(run_cli("serve", "--model", tiny, "--port", str(port)), f"port {port}", "in use")


def test_bad_numbers(tiny: str, run_cli) -> None:
    assert_usage_error(run_cli("generate", "hi", "--model", tiny, "--max-tokens", "0"), "--max-tokens")
    assert_usage_error(run_cli("generate", "hi", "--model", tiny, "--max-model-len", "100000"), "--max-model-len")
    assert_usage_error(run_cli("serve", "--model", tiny, "--kv-cache-memory", "lots"), "lots")
    assert_usage_error(run_cli("serve", "--model", tiny, "--num-kv-pages", "2", "--max-model-len", "256"), "pages")
    assert_usage_error(run_cli("serve", "--model", tiny, "--max-restarts", "-1"), "--max-restarts")
    assert_usage_error(run_cli("serve", "--model", tiny, "--recovery-timeout", "0"), "--recovery-timeout")


def test_corrupt_model_file(tmp_path, run_cli) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    assert_usage_error(run_cli("generate", "hi", "--model", str(bad)), "broken.gguf")


def test_weight_formats_the_model_or_dtype_cannot_run(tiny: str, tmp_path, run_cli) -> None:
    assert_usage_error(run_cli("generate", "hi", "--model", tiny, "--weight-format", "int4"), "4-bit GGUF matrices")
    q4 = str(write_tiny_gguf(tmp_path / "tiny-q4.gguf"))
    assert_usage_error(
        run_cli("generate", "hi", "--model", q4, "--weight-format", "mixed", "--dtype", "fp32"),
        "weight format mixed", "bf16 or fp16",
    )


def time_wait_port() -> int:
    """A port whose only socket is a closed connection in TIME_WAIT, as a stopped uvicorn leaves it
    (its listener sets SO_REUSEADDR, and the connections it accepts inherit it)."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
        client.recv(1)
        client.close()
    time.sleep(0.2)  # the last ACK
    return port


def test_a_port_in_time_wait_is_free_as_uvicorn_sees_it() -> None:
    from tp_runtime.cli import check_port_free

    port = time_wait_port()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # without SO_REUSEADDR the port looks taken
    check_port_free("127.0.0.1", port)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ConfigError, match="in use"):
            check_port_free("127.0.0.1", busy.getsockname()[1])


def test_bad_multi_host_options(tiny: str, tmp_path, run_cli) -> None:
    hosts = ("--nnodes", "2", "--master-addr", "127.0.0.1")
    assert_usage_error(run_cli("generate", "hi", "--model", tiny, "-tp", "2", *hosts), "--frame-key-dir")
    assert_usage_error(run_cli("generate", "hi", "--model", tiny, "-tp", "2", *hosts, "--node-rank", "2"), "--node-rank")
    assert_usage_error(run_cli("generate", "hi", "--model", tiny, "-tp", "3", *hosts), "--tensor-parallel-size 3")
    keys = tmp_path / "keys"
    assert run_cli("keys", str(keys), "--hosts", "a", "b").returncode == 0
    assert_usage_error(run_cli("keys", str(keys), "--hosts", "a"), "exists")
    os.chmod(keys / "a" / "frame.key", 0o644)
    assert_usage_error(run_cli("generate", "hi", "--model", tiny, "-tp", "2", *hosts, "--frame-key-dir", str(keys / "a")), "0644")
    os.chmod(keys / "a" / "frame.key", 0o600)
    os.remove(keys / "b" / "server.key_secret")
    assert_usage_error(run_cli("generate", "hi", "--model", tiny, "-tp", "2", *hosts, "--frame-key-dir", str(keys / "b")), "server.key_secret")
