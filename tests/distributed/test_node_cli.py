"""``rlcollect node``'s secret options: missing, unprotected or too short secrets are one-line
errors (exit code 2) before anything connects; the variable is read when no file is given."""

from __future__ import annotations

import os

import pytest

from rlcollect import cli
from rlcollect.distributed.control.auth import SECRET_ENV, new_secret, write_secret_file

pytestmark = pytest.mark.timeout(60)
BASE = ["node", "--master-addr", "127.0.0.1", "--master-port", "1", "--rank", "1", "--world-size", "2"]


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_a_node_without_a_secret_is_refused(monkeypatch, capsys):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    err = _error(BASE, capsys)
    assert "missing --secret-file PATH (or $RLCOLLECT_SECRET)" in err and len(err.strip().splitlines()) == 1


def test_a_secret_file_others_can_read_is_refused(tmp_path, capsys):
    path = write_secret_file(new_secret(), tmp_path)
    os.chmod(path, 0o644)
    err = _error([*BASE, "--secret-file", str(path)], capsys)
    assert "readable by other users" in err and f"chmod 600 {path}" in err


@pytest.mark.parametrize("content", [b"short", b""])
def test_a_short_secret_is_refused(tmp_path, capsys, content):
    path = tmp_path / "secret"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    err = _error([*BASE, "--secret-file", str(path)], capsys)
    assert "at least 16 are needed" in err


def test_a_missing_secret_file_is_named(tmp_path, capsys):
    err = _error([*BASE, "--secret-file", str(tmp_path / "nope")], capsys)
    assert "cannot read the secret file" in err and "nope" in err


def test_rank0_timeout_must_be_positive(tmp_path, capsys):
    path = write_secret_file(new_secret(), tmp_path)
    err = _error([*BASE, "--secret-file", str(path), "--rank0-timeout", "0"], capsys)
    assert "--rank0-timeout must be a positive number of seconds" in err
