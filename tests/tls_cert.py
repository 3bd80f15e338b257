"""A self-signed certificate for 127.0.0.1 made by the openssl command (TLS tests skip without it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def self_signed(folder: Path) -> tuple[Path, Path]:
    """(cert.pem, key.pem) in folder: an EC key and a certificate for localhost / 127.0.0.1, valid a day."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1", "-days", "1",
                    "-keyout", str(folder / "key.pem"), "-out", str(folder / "cert.pem")], check=True,
                   capture_output=True)
    return folder / "cert.pem", folder / "key.pem"
