"""The run's secret and the keys that authenticate the control plane.

Every control message (both directions) and every heartbeat carries an HMAC-SHA256 over its
header and payload (see ``protocol.encode``).  The secret itself never enters the store, the
process group or a command line:

- ``"mp"``: rank 0 draws it and writes it into a pipe the node process inherits;
- ``"submitit"``: rank 0 writes it into a 0600 file in the job folder and hands the job the path;
- external nodes (``rlcollect node``) and ``"submitit_delayed"``: ``--secret-file PATH`` /
  ``secret_file=PATH`` (the same file on both sides) or ``$RLCOLLECT_SECRET``.

Two keys are derived from the secret, one per direction, so that a message rank 0 sent can never
be replayed as if a node had sent it (and the reverse).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import tempfile
from pathlib import Path

logger = logging.getLogger("rlcollect")

#: The environment variable a node (and rank 0 of external nodes) reads the secret from.
SECRET_ENV = "RLCOLLECT_SECRET"
#: A secret shorter than this is refused (a password-like string is too easy to guess).
MIN_SECRET_BYTES = 16
MAC_BYTES = hashlib.sha256().digest_size


class SecretError(ValueError):
    """The secret is missing, too short or unreadable."""


def new_secret() -> bytes:
    """A fresh secret: 64 hex characters (32 random bytes), printable so it fits a file or an
    environment variable."""
    return secrets.token_hex(32).encode()


def check_secret(secret: bytes, where: str) -> bytes:
    secret = secret.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"the secret from {where} has {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed "
                          "(make one with: python -c 'import secrets; print(secrets.token_hex(32))')")
    return secret


def read_secret_file(path: str | os.PathLike) -> bytes:
    """The secret in ``path`` (surrounding whitespace ignored).  A file other users can read is
    refused: anyone who reads it can run code on the nodes."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as err:
        raise SecretError(f"cannot read the secret file {str(path)!r}: {err.strerror or err}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"the secret file {str(path)!r} is readable by other users (mode {stat.filemode(mode)}): "
                          f"run chmod 600 {path}")
    return check_secret(data, f"file {str(path)!r}")


def secret_from_env() -> bytes | None:
    value = os.environ.get(SECRET_ENV)
    return None if value is None else check_secret(value.encode(), f"${SECRET_ENV}")


def write_secret_file(secret: bytes, folder: str | os.PathLike | None = None) -> Path:
    """Write ``secret`` to a new 0600 file in ``folder`` (None: a new private temporary
    folder) and return its path."""
    folder = Path(tempfile.mkdtemp(prefix="rlcollect-")) if folder is None else Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rlcollect-secret-{secrets.token_hex(8)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
    return path


def remove_secret_file(path: Path | None, folder_too: bool = False) -> None:
    if path is None:
        return
    try:
        path.unlink()
        if folder_too:
            path.parent.rmdir()
    except OSError:
        pass


class Keys:
    """The two message keys of a run: ``to_node`` (what rank 0 signs, nodes check) and
    ``to_rank0`` (what nodes sign, rank 0 checks)."""

    def __init__(self, secret: bytes):
        secret = check_secret(secret, "the run")
        self.to_node = hmac.new(secret, b"rlcollect control plane: rank 0 -> node", hashlib.sha256).digest()
        self.to_rank0 = hmac.new(secret, b"rlcollect control plane: node -> rank 0", hashlib.sha256).digest()

    def __repr__(self) -> str:  # never print key material
        return "Keys(<hidden>)"


def mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def verify(key: bytes, tag: bytes, body: bytes) -> bool:
    return hmac.compare_digest(tag, mac(key, body))


class DropLog:
    """Log a dropped message once per (where, claimed sender); later ones are only counted."""

    def __init__(self, who: str):
        self.who = who
        self.counts: dict[tuple[str, str], int] = {}

    #: Distinct (where, sender) pairs logged; beyond it (a forger claiming ever new ranks)
    #: the rest share one line, so no forger can flood the log or grow this table.
    MAX_SENDERS = 64

    def drop(self, where: str, sender: str, reason: str) -> None:
        key = (where, sender)
        if key not in self.counts and len(self.counts) >= self.MAX_SENDERS:
            key = ("*", "more senders")
            sender = "any of many more senders"
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.counts[key] == 1:
            logger.error("%s: dropped a message on %s claiming to come from %s: %s (further ones from this sender "
                         "are dropped silently)", self.who, where, sender, reason)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
