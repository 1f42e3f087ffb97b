"""TLS on the picker's gRPC listener (config ``tls``): the credentials of its certificate files, read again for new
connections once the files change, as cert-manager renews a Secret in place.

Gateways that speak TLS to an endpoint picker by default (NGINX Gateway Fabric; Istio with a TLS DestinationRule)
need it; so does any path between gateway and picker that a NetworkPolicy alone does not keep private. gRPC reads
the files through `CertificateFiles.fetch` at each TLS handshake: a stat of each file, and a read only after a
change. Envoy keeps its few HTTP/2 connections to the picker for long, so handshakes are rare. A renewal caught
half-written (a key that does not match its certificate yet) leaves the certificate in force until the next
handshake finds the pair whole.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import grpc

from inferlb.scorer.credentials import FileStamp, file_stamp
from inferlb.scorer.errors import ConfigError

__all__ = ["CertificateFiles", "server_credentials"]

logger = logging.getLogger(__name__)


class CertificateFiles:
    """A certificate chain and its private key (PEM files), checked to be a pair when read."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file = Path(cert_file)
        self.key_file = Path(key_file)
        self.reads = 0
        self._stamp = self._stamps()
        self._current = self._read()  # ConfigError at start-up: nothing to serve with

    def _stamps(self) -> tuple[FileStamp | None, FileStamp | None]:
        return file_stamp(self.cert_file), file_stamp(self.key_file)

    def _read(self) -> grpc.ServerCertificateConfiguration:
        """The files' pair, checked with the ssl module (a key of another certificate, or one with a pass phrase,
        is refused here, not at a client's handshake); ConfigError naming the files. The bytes served are those
        checked: a file rewritten between the reads is refused (and read again at the next handshake)."""
        pair = self._bytes()
        try:
            # No pass phrase: without it OpenSSL would ask for one on the terminal (and wait there, if there is one).
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.cert_file, self.key_file, password=_no_passphrase)
        except (ssl.SSLError, ValueError, OSError, _EncryptedError) as exc:
            why = "the key is encrypted: give it without a pass phrase" if isinstance(exc, _EncryptedError) else exc
            raise ConfigError(
                f"tls: {self.cert_file} and {self.key_file} are not a PEM certificate chain and its private key ({why})"
            ) from None
        if self._bytes() != pair:
            raise ConfigError(f"tls: {self.cert_file} or {self.key_file} changed while being read")
        self.reads += 1
        chain, key = pair
        return grpc.ssl_server_certificate_configuration([(key, chain)])

    def _bytes(self) -> tuple[bytes, bytes]:
        pair: list[bytes] = []
        for name, path in (("tls.cert_file", self.cert_file), ("tls.key_file", self.key_file)):
            try:
                pair.append(path.read_bytes())
            except OSError as exc:
                raise ConfigError(f"{name}: cannot read {path}: {exc.strerror or exc}") from None
        return pair[0], pair[1]

    def initial(self) -> grpc.ServerCertificateConfiguration:
        return self._current

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """What gRPC asks at each handshake: the pair read again if either file changed (None: keep the one in
        force)."""
        stamp = self._stamps()
        if stamp == self._stamp:
            return None
        try:
            current = self._read()
        except ConfigError as exc:
            logger.warning("tls: the certificate files changed but cannot be used yet; the old pair stays: %s", exc)
            return None  # read again at the next handshake
        except Exception:  # gRPC would drop it with a line of its own: say what happened, keep the pair in force
            logger.exception("tls: reading the renewed certificate files failed; the old pair stays")
            return None
        self._stamp = stamp
        logger.info("tls: serving the renewed certificate of %s", self.cert_file)
        return current


class _EncryptedError(Exception):
    """The private key asks for a pass phrase."""


def _no_passphrase() -> bytes:
    raise _EncryptedError


def server_credentials(files: CertificateFiles) -> grpc.ServerCredentials:
    """TLS credentials for a gRPC server that follow ``files``."""
    return grpc.dynamic_ssl_server_credentials(files.initial(), files.fetch)
