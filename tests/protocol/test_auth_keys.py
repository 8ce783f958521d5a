"""Per-launch keys, the replay guard, and the operator's key directories (protocol.curve)."""

from __future__ import annotations

import os
import stat

import pytest

from protocol.auth import KEY_BYTES, ReplayGuard, new_key
from protocol.curve import load_keys, write_key_directories
from protocol.errors import KeyFileError, ProtocolError, RejectCode


def test_new_keys_are_32_random_bytes() -> None:
    keys = {new_key() for _ in range(8)}
    assert len(keys) == 8
    assert all(len(k) == KEY_BYTES == 32 for k in keys)


def test_replay_guard_accepts_only_increasing_seq_per_sender() -> None:
    guard = ReplayGuard()
    guard.check(0, 5)
    guard.check(0, 9)  # gaps are fine: a sender's frames to other peers use the numbers between
    guard.check(1, 1)  # each sender has its own count
    for stale in (9, 8):
        with pytest.raises(ProtocolError) as info:
            guard.check(0, stale)
        assert info.value.code == RejectCode.REPLAY
        assert "not above 9" in info.value.message
    guard.check(0, 10)
    guard.forget(0)
    guard.check(0, 1)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_key_directories_give_each_host_what_it_needs(tmp_path) -> None:
    dirs = write_key_directories(tmp_path / "keys", ["node-a", "node-b"], scheduler_host="node-a")
    a, b = load_keys(dirs["node-a"]), load_keys(dirs["node-b"])
    assert a.frame_key == b.frame_key and len(a.frame_key) == KEY_BYTES
    # node-a runs the scheduler: it admits both executors' keys, and pins its own server key.
    assert a.server is not None and b.server is None
    assert a.server.allowed_clients == {a.client.public_key, b.client.public_key}
    assert a.client.server_key == b.client.server_key == a.server.public_key
    assert a.client.public_key != b.client.public_key
    # Secrets are private, and node-b holds no secret but its own.
    for d in dirs.values():
        assert mode(d) == 0o700
        for name in os.listdir(d):
            if name.endswith("key_secret") or name == "frame.key":
                assert mode(d / name) == 0o600, name
    assert sorted(os.listdir(dirs["node-b"])) == ["client.key_secret", "frame.key", "server.key"]
    assert sorted(os.listdir(dirs["node-a"] / "clients")) == ["node-a.key", "node-b.key"]
    with pytest.raises(KeyFileError, match="never overwritten"):
        write_key_directories(tmp_path / "keys", ["node-a"], scheduler_host="node-a")


@pytest.mark.parametrize("name", ["frame.key", "client.key_secret", "server.key_secret"])
def test_secret_files_others_can_read_are_refused_naming_the_file(tmp_path, name) -> None:
    d = write_key_directories(tmp_path / "keys", ["a"], scheduler_host="a")["a"]
    (d / name).chmod(0o644)
    with pytest.raises(KeyFileError, match=rf"{name} has mode 0644.*chmod 600"):
        load_keys(d)
    (d / name).chmod(0o640)
    with pytest.raises(KeyFileError, match="group or others can read it"):
        load_keys(d)
    (d / name).chmod(0o400)
    load_keys(d)


def test_broken_key_directories_are_refused_with_a_sentence(tmp_path) -> None:
    with pytest.raises(KeyFileError, match="does not exist"):
        load_keys(tmp_path / "missing")
    d = write_key_directories(tmp_path / "keys", ["a", "b"], scheduler_host="a")["a"]
    (d / "frame.key").chmod(0o600)
    (d / "frame.key").write_bytes(b"short")
    with pytest.raises(KeyFileError, match="holds 5 bytes, not 32"):
        load_keys(d)
    for path in (d / "clients").iterdir():
        path.unlink()
    with pytest.raises(KeyFileError, match="would admit nobody"):
        load_keys(d)
    (d / "server.key").write_text("not a certificate")
    with pytest.raises(KeyFileError, match="server.key is not a readable zmq certificate"):
        load_keys(d)
    with pytest.raises(KeyFileError, match="must be distinct"):
        write_key_directories(tmp_path / "other", ["a", "a"], scheduler_host="a")
