"""The harness's process control: identity by pid and start time, the tags that find orphans, a
real server's processes signalled one by one, and the session check that kills what a test left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from scripts.harness.client import wait_for_health
from scripts.harness.executors import ExecutorCluster
from scripts.harness.metrics import M_STEPS
from scripts.harness.processes import (
    CLUSTER_ENV,
    REPO_ROOT,
    RUN_ENV,
    ProcessRef,
    ProcessTracker,
    descendants,
    environ,
    run_tag,
    spawn,
    tagged,
    wait_gone,
)
from scripts.harness.runtime import RuntimeServer, ServerOptions
from tests.tiny_models import write_tiny_llama

MIB = 1 << 20
SLEEPER = ["-c", "import time; time.sleep(120)"]
# A parent that starts a sleeping child, prints its pid and exits: the child is orphaned.
ORPHANER = [
    "-c",
    "import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "print(child.pid, flush=True)",
]


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_ref_is_the_process_not_the_pid():
    child = subprocess.Popen([sys.executable, *SLEEPER])
    try:
        ref = ProcessRef.of(child.pid, "sleeper")
        assert ref is not None and ref.alive() and ref.label == "sleeper"
        stranger = ProcessRef(child.pid, ref.start_ticks + 1, "an earlier holder of the pid")
        assert not stranger.alive() and not stranger.signal(signal.SIGKILL) and stranger.rss_bytes() is None
        assert ref.alive(), "a ref whose start time differs must never signal the pid's new holder"
        assert ref.signal(signal.SIGSTOP) and wait_until(ref.stopped)
        assert ref.signal(signal.SIGCONT) and wait_until(lambda: not ref.stopped())
        assert ref.signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert not ref.alive() and not ref.signal(signal.SIGKILL) and ProcessRef.of(child.pid) is None
    finally:
        child.kill()
        child.wait()


def test_spawned_processes_and_their_children_carry_the_tags(tmp_path):
    tracker = ProcessTracker()
    parent = spawn(ORPHANER, cluster_tag=tracker.tag, log_path=tmp_path / "out.log")
    try:
        parent.wait(timeout=30)
        orphan = int((tmp_path / "out.log").read_text().split()[0])
        assert orphan not in descendants(os.getpid()), "its parent exited: it is no longer below us"
        assert environ(orphan)[RUN_ENV] == run_tag() and environ(orphan)[CLUSTER_ENV] == tracker.tag
        assert [ref.pid for ref in tagged(CLUSTER_ENV, tracker.tag)] == [orphan]
        assert [ref.pid for ref in tracker.survivors()] == [orphan]
        assert [ref.pid for ref in tracker.kill_survivors()] == [orphan]
        assert wait_gone(tracker.survivors(), 10) == []
    finally:
        tracker.kill_survivors()


def test_descendants_lists_grandchildren_first_generation_first():
    parent = subprocess.Popen(
        [sys.executable, *ORPHANER[:1], ORPHANER[1] + "; import time; time.sleep(120)"], stdout=subprocess.PIPE
    )
    try:
        grandchild = int(parent.stdout.readline())
        below = descendants(os.getpid())
        assert below.index(parent.pid) < below.index(grandchild)
        assert descendants(parent.pid) == [grandchild]
    finally:
        for ref in filter(None, (ProcessRef.of(grandchild), ProcessRef.of(parent.pid))):
            ref.signal(signal.SIGKILL)
        parent.wait()


@pytest.mark.timeout(300)
def test_a_server_is_known_by_pid_and_stopped_with_its_orphans(tmp_path):
    model = write_tiny_llama(tmp_path / "model", num_heads=6, num_kv_heads=3)
    options = ServerOptions(
        tensor_parallel_size=2, model=str(model), dtype="fp32", num_kv_pages=64, max_model_len=128,
        max_num_seqs=4, max_num_batched_tokens=128,
    )  # fmt: skip
    server = RuntimeServer(options, tmp_path / "server.log")
    with server:
        processes = server.processes()
        assert set(processes) == {"launcher", "rank0", "rank1", "frontend"}
        assert len({ref.pid for ref in processes.values()}) == 4 and server.pid == processes["launcher"].pid
        # `tp-runtime serve` runs the frontend beside the ranks, so that it outlives their group.
        assert processes["frontend"].pid in descendants(server.pid)
        assert processes["frontend"].pid not in descendants(processes["rank0"].pid)
        assert server.process_of(1) == processes["rank1"] and server.process_of("frontend") == processes["frontend"]
        rss = server.rss()
        assert set(rss) == {"rank0", "rank1", "frontend"} and min(rss.values()) > 10 * MIB
        assert server.health() == 200 and server.metrics()[M_STEPS] >= 0
        assert server.wait_health(lambda status: status == 200, timeout_s=5).status == 200
        with pytest.raises(TimeoutError, match="still answered 200"):
            server.wait_health(lambda status: status == 503, timeout_s=0.3)

        server.signal(1, signal.SIGSTOP)
        assert wait_until(server.process_of(1).stopped)
        server.signal("rank1", signal.SIGCONT)
        assert wait_until(lambda: not server.process_of(1).stopped())

        # Killed by -9, torchrun's agent cannot stop its workers: whatever of them and of the
        # frontend lives on is reparented, out of reach of a walk down from the launcher.
        server.signal("launcher", signal.SIGKILL)
        server.process.wait(timeout=10)
        # Survivors first: an orphan may still be on its way out (a rank whose agent died), and
        # one alive after the look was alive at it.
        found = {ref.label for ref in server.survivors()}
        orphans = {label for label, ref in processes.items() if ref.alive()}
        assert orphans <= found, (orphans, found)
        assert descendants(server.pid) == []
        assert server.stop() == -signal.SIGKILL
    assert server.survivors() == [] and not any(ref.alive() for ref in processes.values())
    assert wait_for_health(server.url, lambda status: status is None, timeout_s=5).status is None
    with pytest.raises(ProcessLookupError, match="rank0 .* is not running"):
        server.signal(0, signal.SIGTERM)


def test_the_session_check_kills_and_reports_what_a_test_left_running(tmp_path):
    pid_file = tmp_path / "leaked.pid"
    (tmp_path / "test_leaks.py").write_text(
        textwrap.dedent(
            f"""
            import subprocess, sys

            def test_starts_a_process_and_forgets_it():
                child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
                open({str(pid_file)!r}, "w").write(str(child.pid))

            def test_clean():
                pass
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "scripts.harness.leak_check", "test_leaks.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    leaked = int(pid_file.read_text())
    survivor = ProcessRef.of(leaked)
    try:
        assert inner.returncode == 1, inner.stdout + inner.stderr
        assert "2 passed" in inner.stdout and "1 process(es) left behind by this session, now killed" in inner.stdout
        assert (
            f"(pid {leaked}:" in inner.stdout
            and "test_leaks.py::test_starts_a_process_and_forgets_it (call)" in inner.stdout
        )
        assert survivor is None, "the check must kill what it reports"
    finally:
        if survivor is not None:  # the inner session's tag is not ours: our own check would miss it
            survivor.signal(signal.SIGKILL)


def test_a_leak_free_session_passes_the_check(tmp_path):
    (tmp_path / "test_clean.py").write_text("def test_nothing():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "scripts.harness.leak_check", "test_clean.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert inner.returncode == 0 and "left behind" not in inner.stdout, inner.stdout + inner.stderr


@pytest.mark.timeout(120)
def test_bare_executors_are_known_by_rank_and_stopped_by_pid(tmp_path):
    from executor.options import ExecutorOptions
    from protocol.auth import new_key
    from protocol.transport import SchedulerEndpoint, ipc_address

    endpoint = SchedulerEndpoint(ipc_address(), new_key(), "harness-test")
    options = ExecutorOptions(
        model="stand-in-v1", num_kv_pages=16, page_size=4, max_num_seqs=8, max_num_batched_tokens=64,
        max_model_len=64, kv_cache_dtype="fp32", dtype="fp32", device="cpu",
    )  # fmt: skip
    try:
        with ExecutorCluster(
            2,
            address=endpoint.address,
            key=endpoint._stamp.key,
            run_id="harness-test",
            options=options,
            load="tests.executor.executor_standin:load_standin",
            log_dir=tmp_path,
        ) as cluster:
            hellos = {endpoint.recv(60_000).rank for _ in range(2)}  # each rank says HELLO, then waits
            assert hellos == {0, 1}
            assert {ref.label for ref in cluster.survivors()} == {"rank0", "rank1"}
            assert set(cluster.rss()) == {"rank0", "rank1"}
            assert cluster.signal(1, signal.SIGKILL).pid == cluster.pids()[1]
            assert cluster.wait_exit(1, 10) == -signal.SIGKILL
            codes = cluster.stop()
        assert codes == {0: -signal.SIGKILL, 1: -signal.SIGKILL} and cluster.survivors() == []
        assert (tmp_path / "rank0.log").exists()
    finally:
        endpoint.close()
