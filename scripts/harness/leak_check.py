"""A pytest plugin: no process that a test started outlives the test session.

At configure time the session gets its own run tag (TP_HARNESS_RUN), which every process started
from then on inherits, whether the harness started it or not, and so do their children (torchrun's
workers, rank 0's frontend). At the end of the session every live process that carries the tag is
a leak: each is named with the test that was running when it started (PYTEST_CURRENT_TEST, inherited
the same way), killed by pid, and the session fails.
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest

from scripts.harness.processes import RUN_ENV, ProcessRef, cmdline, environ, tagged, wait_gone

EXIT_GRACE_S = 5.0  # a process that is already on its way out gets this long
# multiprocessing's helper processes live as long as this one and end with it.
_OWN_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def pytest_configure(config: pytest.Config) -> None:
    os.environ[RUN_ENV] = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def strays(tag: str) -> list[ProcessRef]:
    """Live processes of this run but this one and multiprocessing's helpers."""
    return [ref for ref in tagged(RUN_ENV, tag) if not any(helper in cmdline(ref.pid) for helper in _OWN_HELPERS)]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    left = wait_gone(strays(os.environ[RUN_ENV]), EXIT_GRACE_S)
    if not left:
        return
    lines = [f"{ref.describe()}, started during {environ(ref.pid).get('PYTEST_CURRENT_TEST', 'no test')}" for ref in left]
    for ref in left:
        ref.signal(signal.SIGKILL)
    wait_gone(left, 10.0)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", f"{len(left)} process(es) left behind by this session, now killed", red=True)
        for line in lines:
            reporter.write_line(line)
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
