"""ipc:// addresses in private directories, and their removal."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

# ipc directories made by ipc_address(), removed by the endpoint that binds there when it closes.
_PRIVATE_DIRS: set[str] = set()

# A Unix socket's path must fit sun_path: 108 bytes with its NUL on Linux, 104 on macOS.
SOCKET_PATH_MAX = 103 if sys.platform == "darwin" else 107
# The longest name the runtime gives a socket in a private directory: "bootstrap.sock",
# "group-<generation>.sock", "<tag>.sock".
SOCKET_NAME_MAX = 20


def private_directory() -> str:
    """A fresh directory only this user can enter (mode 0700), for sockets: in the temporary
    directory (TMPDIR), or in /tmp where TMPDIR is so deep that a socket in it could not be bound
    (the frontend failed at start with "AF_UNIX path too long")."""
    base = None
    longest = os.path.join(tempfile.gettempdir(), "tp-runtime-" + "x" * 8, "x" * SOCKET_NAME_MAX)
    if len(os.fsencode(longest)) > SOCKET_PATH_MAX and os.path.isdir("/tmp"):
        base = "/tmp"
    directory = tempfile.mkdtemp(prefix="tp-runtime-", dir=base)
    os.chmod(directory, 0o700)
    return directory


def ipc_address(tag: str = "sched") -> str:
    """An ipc:// address inside a fresh private_directory()."""
    if not tag.replace("-", "").replace("_", "").isalnum() or len(tag) + len(".sock") > SOCKET_NAME_MAX:
        raise ValueError(f"ipc tag {tag!r} must be letters, digits, '-' or '_', at most {SOCKET_NAME_MAX - 5} of them")
    directory = private_directory()
    _PRIVATE_DIRS.add(directory)
    return f"ipc://{directory}/{tag}.sock"


def remove_private_dir(address: str) -> None:
    """Removes the directory ipc_address() made for `address`, if it made one: what an endpoint
    that bound there does when it closes. Any other address is left alone."""
    if address.startswith("ipc://"):
        directory = os.path.dirname(address[len("ipc://") :])
        if directory in _PRIVATE_DIRS:
            _PRIVATE_DIRS.discard(directory)
            shutil.rmtree(directory, ignore_errors=True)


def remove_private_dirs() -> None:
    """Removes every directory ipc_address() made in this process that no endpoint has removed: for
    a process that exits while, or before, its endpoint binds there (a signal between the two)."""
    while _PRIVATE_DIRS:
        shutil.rmtree(_PRIVATE_DIRS.pop(), ignore_errors=True)
