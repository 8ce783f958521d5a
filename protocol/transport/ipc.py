"""ipc:// addresses in private directories, and their removal."""

from __future__ import annotations

import os
import shutil
import tempfile

# ipc directories made by ipc_address(), removed by the endpoint that binds there when it closes.
_PRIVATE_DIRS: set[str] = set()


def ipc_address(tag: str = "sched") -> str:
    """An ipc:// address inside a fresh directory only this user can enter (mode 0700)."""
    if not tag.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"ipc tag {tag!r} must be letters, digits, '-' or '_'")
    directory = tempfile.mkdtemp(prefix="tp-runtime-")
    os.chmod(directory, 0o700)
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
