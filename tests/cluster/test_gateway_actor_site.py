"""TLS and --root-path on Ray: `shoal serve` hands the gateway actor its HttpSite's SiteSpec (paths, not an
SSLContext, which does not pickle), and the actor serves HTTPS under the prefix as the in-process server does;
a certificate the actor's node cannot load stops it before any replica loads, naming the flag."""

from __future__ import annotations

import json
import pickle
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from argparse import Namespace
from pathlib import Path

import pytest
from tls_cert import self_signed

from runtime.config import ServerArgs
from runtime.errors import ServerArgsError
from runtime.gateway.http_site import SiteSpec, http_site, open_site, site_spec


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


def _ns(**given: object) -> Namespace:
    flags = dict.fromkeys(("ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "ssl_cert_reqs", "root_path"))
    return Namespace(**{**flags, **given})


def _call(url: str, trust: ssl.SSLContext | None, body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, context=trust, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_site_spec_crosses_and_reopens(cert, monkeypatch, tmp_path):
    """The spec pickles (Ray sends it), holds absolute paths (the actor's working directory is Ray's) and
    opens to the same site; a bad value that did not come through argparse is still named."""
    certfile, keyfile = cert
    monkeypatch.chdir(certfile.parent)
    spec = site_spec(_ns(ssl_certfile="cert.pem", ssl_keyfile="key.pem", ssl_cert_reqs=0, root_path="/api/"))
    assert spec == SiteSpec(ssl_certfile=str(certfile), ssl_keyfile=str(keyfile), ssl_cert_reqs=0,
                            root_path="/api")
    assert pickle.loads(pickle.dumps(spec)) == spec
    site = open_site(spec)
    assert (site.scheme, site.root_path, site.spec) == ("https", "/api", spec)
    assert site_spec(_ns()) == SiteSpec() and http_site(_ns()).ssl_context is None
    with pytest.raises(ServerArgsError, match="must be 0, 1 or 2") as info:
        open_site(SiteSpec(ssl_certfile=str(certfile), ssl_keyfile=str(keyfile), ssl_cert_reqs=7))
    assert info.value.flag == "--ssl-cert-reqs"
    for bad in ("api", "/api/"):  # a spec built in Python is checked as the flag is
        with pytest.raises(ServerArgsError, match="must start with|without a trailing") as info:
            open_site(SiteSpec(root_path=bad))
        assert info.value.flag == "--root-path"
    with pytest.raises(ServerArgsError, match="must be a path") as info:
        open_site(SiteSpec(ssl_certfile=5))  # type: ignore[arg-type]
    assert info.value.flag == "--ssl-certfile"


def test_an_encrypted_key_is_refused_where_no_one_can_type_its_passphrase(cert, tmp_path):
    """The gateway actor opens the files with no terminal: an encrypted key is named, not a prompt that hangs."""
    certfile, keyfile = cert
    locked = tmp_path / "locked.pem"
    subprocess.run(["openssl", "pkey", "-in", str(keyfile), "-aes256", "-passout", "pass:secret", "-out", str(locked)],
                   check=True, capture_output=True)
    spec = SiteSpec(ssl_certfile=str(certfile), ssl_keyfile=str(locked))
    with pytest.raises(ServerArgsError, match="is encrypted; the Ray gateway actor cannot ask") as info:
        open_site(spec, interactive=False)
    assert info.value.flag == "--ssl-keyfile"


@pytest.mark.ray
def test_gateway_actor_with_a_certificate_it_cannot_load_says_which(ray_local, tiny_llama, tmp_path):
    """A file missing on the actor's node: the actor's start() fails before loading replicas, naming the flag."""
    from runtime.cluster.launch import launch_gateway_actor
    from runtime.errors import EngineUnavailableError

    args = ServerArgs(model_path=str(tiny_llama), use_ray=True, device="cpu", max_total_tokens=1024)
    missing = SiteSpec(ssl_certfile=str(tmp_path / "gone.pem"))
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailableError, match="ServerArgsError: --ssl-certfile: cannot load the certificate"):
        launch_gateway_actor(args, port=0, site=missing)
    assert time.monotonic() - t0 < 20  # no replica was loaded first


@pytest.mark.ray
def test_cli_on_ray_serves_tls_under_root_path(ray_local, tiny_llama, cert):
    """serve_gateway_actor with --ssl-certfile/--ssl-keyfile/--root-path: HTTPS only, at / and under /api,
    greedy tokens as HF's."""
    from tiny_models import hf_greedy_ids

    from runtime.entrypoints.gateway_launcher import serve_gateway_actor

    certfile, keyfile = cert
    site = http_site(_ns(ssl_certfile=str(certfile), ssl_keyfile=str(keyfile), root_path="/api"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ServerArgs(model_path=str(tiny_llama), use_ray=True, device="cpu", max_total_tokens=1024, port=port)
    stop = threading.Event()
    runner = threading.Thread(target=serve_gateway_actor, args=(args, stop, site), daemon=True)
    runner.start()
    url = f"https://127.0.0.1:{port}"
    trust = ssl.create_default_context(cafile=str(certfile))
    try:
        deadline = time.monotonic() + 120
        while True:  # 503 (or no answer yet) until the replica is loaded
            try:
                if _call(url + "/api/health", trust)[0] == 200:
                    break
            except urllib.error.URLError:
                pass
            assert runner.is_alive() and time.monotonic() < deadline, "the gateway actor never answered"
            time.sleep(0.5)
        assert _call(url + "/health", trust)[0] == 200
        assert _call(url + "/apix/health", trust)[0] == 404
        prompt = [1, 5, 9, 14, 3]
        status, body = _call(url + "/api/generate", trust, {"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
        assert status == 200, body
        assert json.loads(body)["output_ids"] == hf_greedy_ids(tiny_llama, prompt, 6)
        with pytest.raises(OSError):  # plain HTTP is not served
            _call(f"http://127.0.0.1:{port}/health", None)
    finally:
        stop.set()
        runner.join(timeout=90)
    assert not runner.is_alive()
