"""The executor raises glibc's mmap and trim thresholds (executor/allocator.py says why)."""

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_both_thresholds():
    # In a child process: the thresholds are process-wide and this one runs the other tests.
    code = "from executor.allocator import retain_freed_memory as r; raise SystemExit(0 if r() else 1)"
    assert subprocess.run([sys.executable, "-c", code], cwd=".", timeout=60).returncode == 0


def test_the_executor_applies_it_before_loading(monkeypatch):
    import executor.worker as worker

    called = []
    monkeypatch.setattr("executor.allocator.retain_freed_memory", lambda: called.append(True) or True)

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        assert called, "retain_freed_memory must run before the weights are loaded"
        raise Loaded

    options = worker.ExecutorOptions(model="m", num_kv_pages=4, max_num_seqs=1, max_num_batched_tokens=1, max_model_len=8)
    with pytest.raises(Loaded):
        worker.run_executor(options, rank=0, world_size=1, address="ipc:///nonexistent", key=b"k" * 32, run_id="r", load=load)
