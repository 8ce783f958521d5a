"""A real `tp-runtime serve` under test: started with typed options, known by the pid of each of
its processes, signalled one by one, and always stopped by pid.

`python -m tp_runtime serve` is torchrun's launcher; it starts the frontend (HTTP server and
scheduler) and one worker per rank, each in a session of its own, and restarts the workers when one
fails (--max-restarts 0 makes a failed rank end the server). Once /health answers 200 every one of
them runs, and the server labels them: `launcher`, `rank0` .. `rank<N-1>`, `frontend`; after a
restart `wait_new_ranks` labels the new workers.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from scripts.harness.client import HealthChange, health_status, wait_for_health
from scripts.harness.metrics import read_metrics
from scripts.harness.processes import (
    ProcessRef,
    ProcessTracker,
    cmdline,
    descendants,
    environ,
    forked_rank,
    free_port,
    listening_unix_sockets,
    rank_label,
    spawn,
    wait_gone,
)
from tp_runtime.signal_watch import STACK_DUMP_SIGNAL

START_TIMEOUT_S = 300.0
STACK_DUMP_WAIT_S = 3.0
STOP_GRACE_S = 20.0  # a drain of short requests takes well under a second
LAUNCHER = "launcher"
FRONTEND = "frontend"


class ServerStartError(RuntimeError):
    """The server exited or stayed unhealthy before it could take requests."""


@dataclass(frozen=True)
class ServerOptions:
    """`tp-runtime serve` flags; None leaves the runtime's default. `extra_args` go last, verbatim,
    for flags that have no field here."""

    tensor_parallel_size: int = 1
    model: str | None = None
    dtype: str | None = None
    weight_format: str | None = None
    kv_cache_dtype: str | None = None
    num_kv_pages: int | None = None
    page_size: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    swap_space: str | None = None
    poison_kv_cache: bool = False
    poison_freed_pages: bool = False
    skip_clears: bool = False
    log_level: str = "warning"
    extra_args: tuple[str, ...] = ()

    def argv(self, port: int) -> list[str]:
        args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", str(self.tensor_parallel_size)]
        optional = (
            ("--model", self.model),
            ("--dtype", self.dtype),
            ("--weight-format", self.weight_format),
            ("--kv-cache-dtype", self.kv_cache_dtype),
            ("--num-kv-pages", self.num_kv_pages),
            ("--page-size", self.page_size),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-model-len", self.max_model_len),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--swap-space", self.swap_space),
            ("--log-level", self.log_level),
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
        return [*args, *self.extra_args]


class RuntimeServer:
    """One `tp-runtime serve` and every process it starts; a context manager, so it is always stopped.

    Output goes to log_path, or to this process's stdout and stderr when there is none. `env` is
    added to the environment the server starts with (TMPDIR: where the frontend makes its ipc
    directory). `checkout` runs another tree's runtime, for a benchmark's side-by-side baseline.
    """

    def __init__(
        self,
        options: ServerOptions,
        log_path: Path | None = None,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        checkout: Path | None = None,
    ) -> None:
        self.options = options
        self.env = dict(env or {})
        self.checkout = checkout  # another tree's runtime (a benchmark's baseline); None: this one
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self._tracker = ProcessTracker()

    def __enter__(self) -> RuntimeServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        """The launcher's pid (torchrun's agent): what `kill <pid>` of a user would signal."""
        if self.process is None:
            raise RuntimeError("the server has not been started")
        return self.process.pid

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        argv = ["-m", "tp_runtime", *self.options.argv(self.port)]
        where = {} if self.checkout is None else {"checkout": self.checkout}
        self.process = spawn(argv, cluster_tag=self._tracker.tag, log_path=self.log_path, env=self.env, **where)
        try:
            launcher = ProcessRef.of(self.process.pid, LAUNCHER)
            if launcher is not None:
                self._tracker.add(launcher)
            self._wait_healthy(timeout_s)
            self._label_processes(timeout_s=10.0)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(f"the server exited with code {code} before it was healthy:\n{self.log_tail()}")
            if health_status(self.url, timeout_s=2.0) == 200:
                return
            time.sleep(0.3)
        raise ServerStartError(f"the server was not healthy within {timeout_s:.0f} s:\n{self.log_tail()}")

    def _tree(self) -> list[int]:
        """The server's processes below its launcher (or launchers: scripts/harness/two_hosts.py)."""
        return descendants(self.pid)

    def _label_processes(self, timeout_s: float) -> None:
        wanted = {FRONTEND, *(rank_label(r) for r in range(self.options.tensor_parallel_size))}
        deadline = time.monotonic() + timeout_s
        while True:
            for pid in self._tree():
                label = process_label(pid)
                ref = ProcessRef.of(pid, label) if label in wanted else None
                if ref is not None:
                    self._tracker.add(ref)
            missing = wanted - set(self._tracker.known())
            if not missing:
                return
            if time.monotonic() > deadline:
                raise ServerStartError(f"healthy, but no process found for {sorted(missing)}:\n{self.log_tail()}")
            time.sleep(0.1)

    def wait_new_ranks(self, timeout_s: float) -> dict[str, ProcessRef]:
        """After the executor group restarted: waits until every rank runs in a process other than
        the one labelled before, labels the new ones, and returns them."""
        ranks = {rank_label(r) for r in range(self.options.tensor_parallel_size)}
        old = {ref.pid for label, ref in self._tracker.known().items() if label in ranks}
        deadline = time.monotonic() + timeout_s
        while True:
            found = {}
            for pid in self._tree():
                label = process_label(pid)
                ref = ProcessRef.of(pid, label) if label in ranks and pid not in old else None
                if ref is not None:
                    found[label] = ref
            if set(found) == ranks:
                for ref in found.values():
                    self._tracker.add(ref)
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"no new process for {sorted(ranks - set(found))} within {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def processes(self, include_launcher: bool = True) -> dict[str, ProcessRef]:
        """label -> process, as labelled at start-up (a process that has since died stays listed)."""
        known = self._tracker.known()
        return {label: ref for label, ref in known.items() if include_launcher or label != LAUNCHER}

    def process_of(self, target: str | int) -> ProcessRef:
        """The process of a label (`launcher`, `frontend`, `rank1`) or of a rank number."""
        return self._tracker.get(rank_label(target) if isinstance(target, int) else target)

    def signal(self, target: str | int, sig: signal.Signals) -> ProcessRef:
        """Sends sig to one process (SIGSTOP a rank, SIGKILL the frontend, SIGTERM the launcher)."""
        ref = self.process_of(target)
        if not ref.signal(sig):
            raise ProcessLookupError(f"{ref.label} (pid {ref.pid}) is not running")
        return ref

    def survivors(self) -> list[ProcessRef]:
        """Every process of this server still alive, orphans included."""
        return self._tracker.survivors()

    def wait_gone(self, timeout_s: float) -> list[ProcessRef]:
        """Waits for every process of this server to exit; returns those still alive at the timeout."""
        return wait_gone(self.survivors(), timeout_s)

    def rss(self) -> dict[str, int]:
        """label -> resident memory of the runtime's processes still alive (the launcher left out)."""
        sizes = {label: ref.rss_bytes() for label, ref in self.processes(include_launcher=False).items()}
        return {label: size for label, size in sizes.items() if size is not None}

    def frame_address(self) -> str:
        """The scheduler's frame socket (ipc://, on one host): where the ranks connect, and where a
        stranger without the key would knock."""
        frontend = self.process_of(FRONTEND)
        found = [
            path for path in listening_unix_sockets(frontend.pid)
            if "/tp-runtime-" in path and not path.endswith("/bootstrap.sock")  # where each group's rank 0 gets its keys
        ]
        if len(found) != 1:
            raise LookupError(f"the frontend (pid {frontend.pid}) listens on {found}, not on one ipc socket")
        return f"ipc://{found[0]}"

    def health(self) -> int | None:
        return health_status(self.url)

    def wait_health(self, until: Callable[[int | None], bool], timeout_s: float) -> HealthChange:
        return wait_for_health(self.url, until, timeout_s)

    def metrics(self) -> dict[str, float] | None:
        return read_metrics(self.url)

    def settled_metrics(self, since: dict[str, float] | None = None, timeout_s: float = 10.0) -> dict[str, float]:
        """The metrics once they count every request that ended: the engine publishes its counters
        when its last step in flight has ended, a moment after the client got its last token, so
        a scrape right after a response may not count it yet. Settled: nothing running or waiting,
        and with `since` (the settled metrics from before some requests) more requests finished
        than then: the snapshot from before the requests says nothing runs either."""
        finished = "tp_runtime_requests_finished_total"
        deadline = time.monotonic() + timeout_s
        while True:
            values = read_metrics(self.url)
            if (
                values is not None
                and not values.get("vllm:num_requests_running")
                and not values.get("vllm:num_requests_waiting")
                and (since is None or values.get(finished, 0.0) > since.get(finished, 0.0))
            ):
                return values
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server's metrics did not settle within {timeout_s:g} s: {values}")
            time.sleep(0.01)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM to the launcher (torchrun passes it to the ranks; the frontend drains), then
        SIGKILL, by pid, to every process of the server still alive after grace_s. Returns the
        launcher's exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        wait_gone(self.survivors(), grace_s)
        killed = self._tracker.kill_survivors()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        wait_gone(killed, 10.0)
        return self.process.returncode

    def left_report(self, left: list[ProcessRef]) -> str:
        """For a failure's message: the processes still alive, and the server's log once each has
        written its Python stacks there (SIGUSR1: tp_runtime/signal_watch.py; a stopped process
        writes nothing until it is continued)."""
        if not left:
            return "nothing left"
        size = self._log_size()
        for ref in left:
            ref.signal(STACK_DUMP_SIGNAL)
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while time.monotonic() < deadline and self._log_size() == size:
            time.sleep(0.05)
        time.sleep(0.2)  # the rest of the dump: faulthandler writes it thread by thread
        return f"still alive: {[ref.describe() for ref in left]}\n{self.log_tail(200)}"

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size if self.log_path is not None else 0
        except OSError:
            return 0

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None:
            return "(the server's output went to this process's stdout and stderr)"
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])


def process_label(pid: int) -> str | None:
    """`frontend`, `rank<N>` for a rank (RANK in its environment, or for a rank that `generate`'s
    launcher forked, which keeps the launcher's environment, the name it gives its thread), else None."""
    if "tp_runtime.frontend" in cmdline(pid):
        return FRONTEND  # rank 0's child inherits RANK=0: the command line tells it apart
    rank = environ(pid).get("RANK")
    if rank is None:
        rank = forked_rank(pid)
    return rank_label(int(rank)) if rank is not None and rank.isdigit() else None


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so that every `with RuntimeServer` stops its server."""

    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
