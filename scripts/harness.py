"""What the soak run and the serving benchmark share: the server process, the streaming client,
/metrics parsing and the memory of the rank processes.

The server is always a real `python -m tp_runtime serve` in its own process group, stopped by that
group in `RuntimeServer.stop` whatever happened; the client speaks plain OpenAI-compatible HTTP so
that `--url` can point the same code at any other server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parent.parent
STOP_GRACE_S = 15.0


class ServerStartError(RuntimeError):
    """The server exited or stayed unhealthy before it could take requests."""


class ProtocolViolation(RuntimeError):
    """The server answered something an OpenAI-compatible stream may not contain."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class ServerOptions:
    """`tp-runtime serve` flags; None leaves the runtime's default."""

    tensor_parallel_size: int = 1
    model: str | None = None
    dtype: str = "bf16"
    weight_format: str = "auto"
    kv_cache_dtype: str = "auto"
    num_kv_pages: int | None = None
    page_size: int = 16
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    swap_space: str | None = None
    poison_kv_cache: bool = False
    poison_freed_pages: bool = False
    skip_clears: bool = False
    log_level: str = "warning"

    def argv(self, port: int) -> list[str]:
        args = [
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--dtype",
            self.dtype,
            "--weight-format",
            self.weight_format,
            "--kv-cache-dtype",
            self.kv_cache_dtype,
            "--page-size",
            str(self.page_size),
            "--log-level",
            self.log_level,
        ]
        optional = (
            ("--model", self.model),
            ("--num-kv-pages", self.num_kv_pages),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-model-len", self.max_model_len),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--swap-space", self.swap_space),
        )
        for flag, value in optional:
            if value is not None:
                args += [flag, str(value)]
        for flag, on in (
            ("--debug-poison-kv-cache", self.poison_kv_cache),
            ("--debug-poison-freed-pages", self.poison_freed_pages),
            ("--debug-skip-clears", self.skip_clears),
        ):
            if on:
                args.append(flag)
        return args


class RuntimeServer:
    """One `tp-runtime serve` process group; use as a context manager so it is always stopped."""

    def __init__(self, options: ServerOptions, log_path: Path, port: int | None = None) -> None:
        self.options = options
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RuntimeServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 300.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH")))))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tp_runtime", *self.options.argv(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO_ROOT,
                env=env,
                start_new_session=True,
            )
        try:
            self._wait_healthy(self.process, timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, process: subprocess.Popen[bytes], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = process.poll()
            if code is not None:
                raise ServerStartError(f"the server exited with code {code} before it was healthy:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerStartError(f"the server was not healthy within {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> int | None:
        """SIGTERM to the whole group (the server drains), SIGKILL if it outlives the grace period."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # Ranks and the frontend are in the same group; none may outlive the server.
        _signal_group(self.process.pid, signal.SIGKILL)
        return self.process.returncode

    def rank_pids(self) -> dict[int, int]:
        """rank -> pid of each torchrun worker: the server's children that carry a RANK."""
        if self.process is None:
            return {}
        ranks: dict[int, int] = {}
        for pid in child_pids(self.process.pid):
            rank = _environ_value(pid, "RANK")
            if rank is not None and rank.isdigit():
                ranks[int(rank)] = pid
        return ranks

    def frontend_pid(self) -> int | None:
        """Rank 0's child that runs the scheduler and the HTTP server."""
        rank0 = self.rank_pids().get(0)
        for pid in child_pids(rank0) if rank0 is not None else []:
            if b"tp_runtime.frontend" in _cmdline(pid):
                return pid
        return None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so that every `with RuntimeServer` stops its server."""

    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def child_pids(pid: int) -> list[int]:
    """Direct children of pid, from /proc (Linux)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: the fields after the last ')' are fixed.
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            children.append(int(entry.name))
    return sorted(children)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _environ_value(pid: int, name: str) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = f"{name}=".encode()
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a live process, None once it has gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> sample name -> value, summed over label sets (`_bucket` samples dropped)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") or sample.name.endswith("_created"):
                continue
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


@dataclass(frozen=True)
class MetricsSample:
    t: float  # seconds since the run started
    values: dict[str, float]

    def get(self, name: str) -> float | None:
        return self.values.get(name)


@dataclass(frozen=True)
class CompletionRequest:
    """One /v1/completions call: a token-id prompt, its sampling, and when the client hangs up."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    cancel_after_tokens: int | None = None  # close the stream after this many tokens

    def body(self, model: str) -> dict[str, object]:
        body: dict[str, object] = {
            "model": model,
            "prompt": list(self.prompt_ids),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


@dataclass
class StreamResult:
    """What the client saw of one streaming completion, with client-side times (perf_counter)."""

    response_ids: set[str] = field(default_factory=set)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None  # the server's stated reason, or the transport failure
    http_status: int | None = None
    cancelled: bool = False  # the client closed the stream on purpose
    done_markers: int = 0  # `data: [DONE]` lines
    after_finish: int = 0  # chunks with text or tokens after the one that carried finish_reason
    completion_tokens: int | None = None  # from the usage chunk
    t_sent: float = 0.0
    t_first: float | None = None
    t_last: float | None = None
    t_end: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.finish_reason in ("length", "stop") and self.error is None and not self.cancelled

    @property
    def output_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids else (self.completion_tokens or self.chunks)

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_sent

    @property
    def tpot_s(self) -> float | None:
        n = self.output_tokens
        if self.t_first is None or self.t_last is None or n < 2:
            return None
        return (self.t_last - self.t_first) / (n - 1)


async def stream_completion(
    client: httpx.AsyncClient, url: str, model: str, request: CompletionRequest, timeout_s: float
) -> StreamResult:
    """Runs one streaming completion to its end, its error, its timeout or its planned cancellation."""
    result = StreamResult(t_sent=time.perf_counter())
    try:
        await asyncio.wait_for(_consume(client, url, model, request, result), timeout_s)
    except asyncio.TimeoutError:
        result.error = f"lost: no end of stream within {timeout_s:.0f} s"
    except httpx.HTTPError as exc:
        result.error = f"transport: {type(exc).__name__}: {exc}"
    result.t_end = time.perf_counter()
    return result


async def _consume(
    client: httpx.AsyncClient, url: str, model: str, request: CompletionRequest, result: StreamResult
) -> None:
    async with client.stream("POST", f"{url}/v1/completions", json=request.body(model)) as response:
        result.http_status = response.status_code
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            result.error = f"HTTP {response.status_code}: {_error_message(body)}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                result.done_markers += 1
                continue
            if _absorb_chunk(json.loads(payload), result, time.perf_counter()):
                return
            cancel_at = request.cancel_after_tokens
            if cancel_at is not None and result.finish_reason is None and len(result.token_ids) >= cancel_at:
                result.cancelled = True
                return  # leaving the context closes the connection mid-stream


def _absorb_chunk(chunk: dict, result: StreamResult, now: float) -> bool:
    """Folds one SSE data object into result; True when it was an error event (the stream ends)."""
    if "error" in chunk:
        error = chunk["error"]
        result.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
        return True
    if "id" in chunk:
        result.response_ids.add(str(chunk["id"]))
    usage = chunk.get("usage")
    if usage:
        result.completion_tokens = int(usage.get("completion_tokens", 0))
    for choice in chunk.get("choices", ()):
        tokens = [int(t) for t in choice.get("token_ids") or ()]
        text = choice.get("text") or ""
        if tokens or text:
            if result.finish_reason is not None:
                result.after_finish += 1
            result.chunks += 1
            result.token_ids.extend(tokens)
            result.text += text
            result.token_times.extend([now] * max(1, len(tokens)))
            if result.t_first is None:
                result.t_first = now
            result.t_last = now
        if choice.get("finish_reason") is not None:
            if result.finish_reason is not None:
                result.after_finish += 1
            result.finish_reason = str(choice["finish_reason"])
    return False


def _error_message(body: str) -> str:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:300]
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return body.strip()[:300]


def served_model(url: str) -> str:
    """The id that /v1/models lists first: requests must name it."""
    response = httpx.get(f"{url}/v1/models", timeout=10.0)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ProtocolViolation(f"{url}/v1/models lists no model")
    return str(models[0]["id"])


async def scrape_metrics(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    """The server's /metrics, or None where it has none (another runtime behind --url)."""
    try:
        response = await client.get(f"{url}/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_metrics(response.text)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def default_out_dir(kind: str) -> Path:
    return REPO_ROOT / "reports" / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
