"""Where the compiled layers' libraries are unpacked when they are loaded, and that the copies of a
process that is gone do not stay on disk (executor/model/kernel_cache.py `unpack_dir`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import executor.model.compiled as compiled
from executor.model import kernel_cache


def gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_folders_of_gone_processes_of_this_host_are_removed_at_the_next_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TP_RUNTIME_CACHE_DIR", str(tmp_path))
    root = kernel_cache.kernel_dir() / "unpacked"
    host = socket.gethostname()
    gone = root / f"{host}-{gone_pid()}" / "aotinductor_x"
    living = root / f"{host}-1" / "aotinductor_y"  # init never ends
    elsewhere = root / f"another-host-{gone_pid()}" / "aotinductor_z"  # a cache folder shared by hosts
    for folder in (gone, living, elsewhere):
        folder.mkdir(parents=True)
        (folder / "wrapper.so").write_bytes(b"\0" * 64)
    mine = kernel_cache.unpack_dir()
    assert mine == root / f"{host}-{os.getpid()}" and mine.is_dir()
    assert not gone.parent.exists()
    assert living.is_dir() and elsewhere.is_dir()


class Spec:
    def key(self) -> str:
        return "spec"


def test_the_loader_unpacks_under_this_process_folder_and_tmpdir_is_left_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TP_RUNTIME_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TMPDIR", "/somewhere")
    seen: list[str] = []

    class Loader:  # stands for torch's, which reads TMPDIR when it unpacks the package
        def __init__(self, *args: object) -> None:
            seen.append(os.environ["TMPDIR"])

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", Loader)
    loaded = compiled._load([Spec(), Spec()])
    assert loaded is not None
    assert seen == [str(kernel_cache.unpack_dir())] * 2
    assert os.environ["TMPDIR"] == "/somewhere"
    monkeypatch.delenv("TMPDIR")
    compiled._load([Spec()])
    assert "TMPDIR" not in os.environ
