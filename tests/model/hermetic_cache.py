"""A pytest plugin (tests/conftest.py loads it): the whole suite runs against a disk cache of its own
(executor/disk_cache.py), never the user's. Compiled decode layers are off unless a test builds
them, so that no executor a test starts counts eager decode time towards a background build (a
detached process that would outlive the session), and the probe's result is fixed, so that no
assertion depends on how fast this machine happened to be (tests/model/test_probe.py tests the
probe itself). The variables are inherited by every process a test starts."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from executor.probe import ProbeResult, probe_path

FIXED_PROBE = ProbeResult(
    dtype="bf16",
    weight_format="mixed",
    int4_max_rows=8,
    reason="fixed by tests/model/hermetic_cache.py",
    timings_ms={},
    threads=0,
    measured_at="",
)


@pytest.fixture(autouse=True, scope="session")
def hermetic_disk_cache(tmp_path_factory: pytest.TempPathFactory):
    patch = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("tp-runtime-cache")
    patch.setenv("TP_RUNTIME_CACHE_DIR", str(root))
    patch.setenv("TP_RUNTIME_COMPILE", "off")
    fix_probe()
    yield root
    patch.undo()


def fix_probe() -> None:
    """FIXED_PROBE under the cache root TP_RUNTIME_CACHE_DIR names now: a test that moves the root
    calls it again, or its loads would time the kernels (seconds quiet, a minute and more with the
    suite's load)."""
    for threads in {1, torch.get_num_threads()}:  # the TP workers run one thread each
        path = probe_path(threads)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(FIXED_PROBE)))
