"""protocol/transport/ipc.py's private directories: every socket the runtime names in one can be
bound, however deep the temporary directory is."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from protocol.transport.ipc import SOCKET_NAME_MAX, ipc_address, private_directory, remove_private_dir


def _binds(directory: str) -> None:
    path = os.path.join(directory, "n" * (SOCKET_NAME_MAX - 5) + ".sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)


@pytest.mark.parametrize("depth", [0, 12])
def test_a_socket_binds_in_a_private_directory_however_deep_tmpdir_is(monkeypatch: pytest.MonkeyPatch, depth: int) -> None:
    # Twelve levels of 9 characters put a socket past sun_path's 108 bytes, as the long stress run's
    # TMPDIR did (the frontend failed to start with "AF_UNIX path too long").
    short = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    deep = short.joinpath(*["level-00"] * depth)
    deep.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    directory = private_directory()
    try:
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert Path(directory).parent == (deep if depth == 0 else Path("/tmp"))
        _binds(directory)
    finally:
        shutil.rmtree(directory)
        shutil.rmtree(short)


def test_an_ipc_tag_too_long_for_a_socket_name_is_refused() -> None:
    with pytest.raises(ValueError, match="at most"):
        ipc_address("t" * SOCKET_NAME_MAX)
    address = ipc_address("t" * (SOCKET_NAME_MAX - 5))
    remove_private_dir(address)
    assert not os.path.exists(os.path.dirname(address[len("ipc://") :]))
