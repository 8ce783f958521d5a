"""Per-launch keys and the replay guard."""

from __future__ import annotations

import os
import stat

import pytest

from protocol.auth import KEY_BYTES, KEY_FILE_ENV, ReplayGuard, key_from_environment, new_key, read_key_file, write_key_file
from protocol.errors import ProtocolError, RejectCode


def test_new_keys_are_32_random_bytes() -> None:
    keys = {new_key() for _ in range(8)}
    assert len(keys) == 8
    assert all(len(k) == KEY_BYTES == 32 for k in keys)


def test_key_file_is_private_and_reads_back(tmp_path, monkeypatch) -> None:
    path = write_key_file(str(tmp_path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = read_key_file(path)
    assert len(key) == 32
    monkeypatch.setenv(KEY_FILE_ENV, path)
    assert key_from_environment() == key


def test_key_file_is_never_overwritten(tmp_path) -> None:
    write_key_file(str(tmp_path))
    with pytest.raises(FileExistsError):
        write_key_file(str(tmp_path))


def test_key_files_others_can_read_or_of_wrong_size_are_refused(tmp_path) -> None:
    loose = tmp_path / "loose.key"
    loose.write_bytes(new_key())
    loose.chmod(0o644)
    with pytest.raises(ProtocolError, match="mode 644"):
        read_key_file(str(loose))
    short = tmp_path / "short.key"
    short.write_bytes(b"abc")
    short.chmod(0o600)
    with pytest.raises(ProtocolError, match="exactly 32 bytes"):
        read_key_file(str(short))
    with pytest.raises(ProtocolError, match="cannot read"):
        read_key_file(str(tmp_path / "missing.key"))


def test_missing_environment_variable_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    with pytest.raises(ProtocolError, match=KEY_FILE_ENV):
        key_from_environment()


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
