"""Start-up trace for scripts/bench_startup.py: on a path that the bench puts first in PYTHONPATH,
so that every process of a launch (the launcher, the ranks, the frontend) imports it as it starts.

It does nothing unless $TP_RUNTIME_STARTUP_TRACE names a file. Then it appends one JSON line per
event to that file: this process starting, and the first entry to and exit from each function
named in $TP_RUNTIME_STARTUP_TRACE_POINTS ("module:qualname,..."), with the clock (CLOCK_MONOTONIC,
one clock for every process of the host) and this process's CPU time. The functions are wrapped
as their modules are first imported, before any other module binds them by name, so the runtime
needs no trace calls of its own and any checkout, the one before a change included, is measured
the same way. A point a tree does not have is simply never seen.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

_PATH = os.environ.get("TP_RUNTIME_STARTUP_TRACE")
_seen: set[str] = set()


def _role() -> str:
    """launcher, rankN or frontend (which inherits RANK where rank 0 starts it). sys.argv is not
    set yet while site runs; sys.orig_argv is."""
    if "tp_runtime.frontend" in getattr(sys, "orig_argv", sys.argv):
        return "frontend"
    return f"rank{os.environ['RANK']}" if "RANK" in os.environ else "launcher"


def record(event: str) -> None:
    if event in _seen:
        return
    _seen.add(event)
    line = {
        "event": event,
        "role": _role(),
        "pid": os.getpid(),
        "t": time.monotonic(),
        "cpu": time.process_time(),
    }
    descriptor = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(descriptor, (json.dumps(line) + "\n").encode())  # one write: lines never interleave
    finally:
        os.close(descriptor)


def _traced(name: str, function):  # noqa: ANN001, ANN202
    @functools.wraps(function)
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        record(f"{name}:enter")
        try:
            return function(*args, **kwargs)
        finally:
            record(f"{name}:exit")

    return wrapper


def _wrap(module, qualname: str) -> None:  # noqa: ANN001
    owner, _, attribute = qualname.rpartition(".")
    holder = module
    for part in filter(None, owner.split(".")):
        holder = getattr(holder, part, None)
    original = getattr(holder, attribute, None) if holder is not None else None
    if callable(original):
        setattr(holder, attribute, _traced(f"{module.__name__}:{qualname}", original))


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, points: dict[str, list[str]]) -> None:
        self.points = points

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name not in self.points:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute, qualnames = spec.loader.exec_module, self.points[name]

        def exec_module(module) -> None:  # noqa: ANN001
            execute(module)
            for qualname in qualnames:
                _wrap(module, qualname)

        spec.loader.exec_module = exec_module
        return spec


def _install() -> None:
    points: dict[str, list[str]] = {}
    for point in filter(None, os.environ.get("TP_RUNTIME_STARTUP_TRACE_POINTS", "").split(",")):
        module, _, qualname = point.partition(":")
        points.setdefault(module, []).append(qualname)
    sys.meta_path.insert(0, _Finder(points))
    os.register_at_fork(after_in_child=_forked)
    record("process:start")


def _forked() -> None:
    """A forked process (a rank the launcher forks) starts its own stamps."""
    _seen.clear()
    record("process:start")


if _PATH:
    _install()
