"""A `tp-runtime serve` of two "hosts" on this machine: two launches with `--nnodes 2`, one per
node rank, meeting through torchrun's c10d rendezvous on loopback, with the operator's key
directories. To the tests and scripts/harness/recovery.py it is one RuntimeServer: node 0 serves
HTTP (the frontend runs there), every process of both launches is labelled (`launcher`, `frontend`,
`rank<N>`) and stopped by pid, and `host_of` says which node a rank runs on.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from scripts.harness.processes import descendants, free_port, spawn
from scripts.harness.runtime import START_TIMEOUT_S, STOP_GRACE_S, RuntimeServer, ServerOptions


class TwoHostServer(RuntimeServer):
    """`options.tensor_parallel_size` ranks split over two nodes; node 1's launcher is `other`."""

    def __init__(self, options: ServerOptions, key_dirs: tuple[str, str], log_dir: Path) -> None:
        super().__init__(options, log_path=log_dir / "node0.log")
        self.key_dirs = key_dirs
        self.other_log = log_dir / "node1.log"
        self.master_port, self.frame_port = free_port(), free_port()
        self.other: subprocess.Popen[bytes] | None = None

    def _node_argv(self, node: int) -> list[str]:
        return [
            "-m", "tp_runtime", *self.options.argv(self.port), "--nnodes", "2", "--node-rank", str(node),
            "--master-addr", "127.0.0.1", "--master-port", str(self.master_port),
            "--frame-key-dir", self.key_dirs[node], "--frame-port", str(self.frame_port),
        ]  # fmt: skip

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        # The two "hosts" share this machine's cores: one thread per rank.
        env = {**self.env, "OMP_NUM_THREADS": "1"}
        self.other = spawn(self._node_argv(1), cluster_tag=self._tracker.tag, log_path=self.other_log, env=env)
        self.process = spawn(self._node_argv(0), cluster_tag=self._tracker.tag, log_path=self.log_path, env=env)
        try:
            self._wait_healthy(timeout_s)
            self._label_processes(timeout_s=10.0)
        except BaseException:
            self.stop()
            raise

    def _tree(self) -> list[int]:
        others = descendants(self.other.pid) if self.other is not None else []
        return [*descendants(self.pid), *others]

    def host_of(self, rank: int) -> int:
        """The node (--node-rank) whose launcher runs `rank`: c10d numbers the hosts by address, so
        global rank 0 may be on either."""
        assert self.other is not None
        return 1 if self.process_of(rank).pid in descendants(self.other.pid) else 0

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM to node 0's launcher (a drain of the whole service), then SIGKILL by pid to every
        process of either host still alive (both launchers carry the server's tag); node 1's
        launcher is reaped too."""
        code = super().stop(grace_s)
        if self.other is not None:
            try:
                self.other.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.other.send_signal(signal.SIGKILL)
                self.other.wait()
        return code

    def log_tail(self, lines: int = 40) -> str:
        try:
            other = "\n".join(self.other_log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            other = "(no log)"
        return f"--- node 0 ---\n{super().log_tail(lines)}\n--- node 1 ---\n{other}"
