"""TLS on the picker's gRPC listener (filter/tls.py): the pair checked when read, and read again only when the
files change, keeping the pair in force while a renewal is half-written."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from inferlb.filter.tls import CertificateFiles
from inferlb.scorer.errors import ConfigError

from ..conftest import self_signed

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl (.ci/run installs it)")


def test_a_key_of_another_certificate_is_refused_naming_the_files(tmp_path: Path) -> None:
    cert = self_signed(tmp_path, "a")
    self_signed(tmp_path, "b")
    with pytest.raises(ConfigError, match=r"^tls: .*a\.crt and .*b\.key are not a PEM certificate chain"):
        CertificateFiles(str(cert), str(tmp_path / "b.key"))
    with pytest.raises(ConfigError, match=r"^tls\.key_file: cannot read .*missing\.key"):
        CertificateFiles(str(cert), str(tmp_path / "missing.key"))
    # A key with a pass phrase: refused with the reason, never a prompt on the terminal (or a wait at one).
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-keyout", "e.key",
         "-out", "e.crt", "-days", "1", "-subj", "/CN=127.0.0.1", "-passout", "pass:secret"],
        cwd=tmp_path, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="the key is encrypted: give it without a pass phrase"):
        CertificateFiles(str(tmp_path / "e.crt"), str(tmp_path / "e.key"))


def test_the_files_are_read_again_only_when_they_change_and_only_as_a_pair(tmp_path: Path) -> None:
    cert = self_signed(tmp_path, "server")
    key = tmp_path / "server.key"
    files = CertificateFiles(str(cert), str(key))
    assert files.fetch() is None and files.reads == 1  # unchanged: no read at a handshake
    renewed = self_signed(tmp_path / "renewed", "server")
    shutil.copy(renewed, cert)  # the certificate first, its key not yet: the old pair stays in force
    assert files.fetch() is None and files.reads == 1
    shutil.copy(renewed.with_suffix(".key"), key)
    assert files.fetch() is not None and files.reads == 2
    assert files.fetch() is None and files.reads == 2
