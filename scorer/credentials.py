"""Credentials the operator gives the picker: a bearer token read from a file or an environment variable.

The config names where the token is, never the token itself, so that a config file can be shared and
shown (``GET /config``) without giving the credential away. ``read`` is called when the picker starts and on
every reload, so a rotated Kubernetes Secret (a mounted file) takes effect without a restart.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from inferlb.scorer.errors import ConfigError

__all__ = ["MIN_TOKEN_CHARS", "Credential", "FileStamp", "TokenSource", "file_stamp"]

MIN_TOKEN_CHARS = 16
"""A shorter token is refused: it could be guessed."""
_MAX_TOKEN_BYTES = 4096

FileStamp = tuple[int, int, int, int]


def file_stamp(path: str | Path) -> FileStamp | None:
    """What tells that a credential file changed: its identity (device and inode: a file put in its place, even with
    the same size and time, is new), modification time and size, following links as a Secret volume's are; None if
    it is absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


@dataclass(frozen=True, slots=True)
class TokenSource:
    """Where a bearer token is: exactly one of ``file`` (a path) and ``env`` (a variable name)."""

    file: str | None = None
    env: str | None = None

    def describe(self) -> str:
        return f"file {self.file}" if self.file is not None else f"environment variable {self.env}"

    def read(self, where: str) -> Credential:
        """The token now; ConfigError naming ``where`` if it cannot be read or is too short."""
        if self.file is not None:
            try:
                raw = Path(self.file).read_bytes()[: _MAX_TOKEN_BYTES + 1]
            except OSError as exc:
                raise ConfigError(f"{where}.token_file: cannot read {self.file}: {exc.strerror or exc}") from None
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ConfigError(f"{where}.token_file: {self.file} is not UTF-8 text") from None
        else:
            assert self.env is not None  # the config sets one of the two
            text = os.environ.get(self.env, "")
        token = text.strip()  # a file written by `echo` ends with a newline
        label = f"{where}.{'token_file' if self.file is not None else 'token_env'} ({self.describe()})"
        if not token:
            raise ConfigError(f"{label} is empty or unset")
        if len(token) < MIN_TOKEN_CHARS or len(token.encode()) > _MAX_TOKEN_BYTES:
            raise ConfigError(
                f"{label}: the token must be {MIN_TOKEN_CHARS}..{_MAX_TOKEN_BYTES} characters "
                f"(e.g. `openssl rand -hex 32`); got {len(token)}"
            )
        if any(c.isspace() or not c.isprintable() for c in token):
            raise ConfigError(f"{label}: the token must be printable characters without spaces")
        return Credential(token.encode())


class Credential:
    """A bearer token held in memory; ``matches`` compares in constant time. Its repr never shows it."""

    __slots__ = ("_token",)

    def __init__(self, token: bytes) -> None:
        self._token = token

    def matches(self, presented: str | bytes | None) -> bool:
        """True when ``presented`` is this token (compared in time independent of where they differ)."""
        if presented is None:
            return False
        raw = presented.encode("utf-8", "surrogateescape") if isinstance(presented, str) else presented
        return hmac.compare_digest(raw, self._token)

    def matches_bearer(self, authorization: str | bytes | None) -> bool:
        """True for an ``Authorization`` value ``Bearer <this token>`` (the scheme is case-insensitive)."""
        if authorization is None:
            return False
        raw = authorization.encode("latin-1", "replace") if isinstance(authorization, str) else authorization
        scheme, _, token = raw.strip().partition(b" ")
        return scheme.lower() == b"bearer" and self.matches(token.strip())

    def reveal(self) -> bytes:
        """The token itself: only to hand it to a process of the picker's own over a private channel (the OTLP
        receiver's child process gets it over a socket pair). Never log or show it."""
        return self._token

    def __repr__(self) -> str:
        return "Credential(<hidden>)"
