"""The live status page (issue 19, item 7): GET /dashboard/data's numbers move under load, and the page
at GET /dashboard, loaded in real headless Chromium, shows them changing every second with a clean
console (skipped with the reason where playwright or Chromium is not installed)."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from http.client import HTTPConnection
from urllib.parse import urlsplit

import pytest
from gw_helpers import GATEWAY_ARGS, http, raw, wait_kv_full

from runtime.gateway.http_site import SiteSpec, open_site
from runtime.gateway.server import serve_in_thread

CHROMIUM = "/usr/bin/chromium"
_LOAD = {"prompt": "Tell me about the sea", "max_tokens": 40, "ignore_eos": True, "n": 2}


@pytest.fixture()
def dash_url(gw_engine) -> Iterator[str]:
    """A gateway of its own: its counters, samples and error log start empty."""
    with serve_in_thread(gw_engine, GATEWAY_ARGS, port=0) as server:
        yield server.url
    wait_kv_full(gw_engine)


class _Load:
    """Clients sending completions until stopped."""

    def __init__(self, url: str, clients: int = 3):
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(url,)) for _ in range(clients)]

    def _run(self, url: str) -> None:
        while not self.stop.is_set():
            assert http(url + "/v1/completions", "POST", _LOAD)[0] == 200

    def __enter__(self) -> _Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def _data(url: str) -> dict:
    status, body = http(url + "/dashboard/data")
    assert status == 200, body
    return body


def test_dashboard_data_moves_under_load(dash_url):
    first = _data(dash_url)
    assert first["ready"] and first["model"] == "llama" and first["requests_total"] == 0
    assert [r["up"] for r in first["replicas"]] == [True]
    assert http(dash_url + "/v1/completions", "POST", {"prompt": "hi", "top_k": 2**63})[0] == 400
    _harmless_requests(dash_url)
    with _Load(dash_url):
        time.sleep(1.5)
        busy = _data(dash_url)
    assert busy["generation_tokens_per_s"] > 0 and busy["requests_total"] > 0
    assert {m["mode"] for m in busy["modes"]} >= {"EXTEND", "DECODE"}
    assert 0 <= busy["kv_usage"] <= 1 and busy["batch_size"] >= 1
    assert busy["replicas"][0]["tokens_per_s"] > 0
    [error] = busy["errors"]  # the unknown routes' 404s are not errors of the server's
    assert (error["path"], error["status"], error["param"]) == ("/v1/completions", 400, "top_k")
    assert len(busy["history"]) == 2 and busy["errors_total"] == 1


def _harmless_requests(url: str) -> None:
    """What a browser or a first look sends beside the API: none is an error on the dashboard."""
    status, headers, icon = raw(url + "/favicon.ico")  # a browser's, on opening any page
    assert status == 200 and headers["Content-Type"] == "image/svg+xml" and icon.startswith(b"<svg")
    status, _, page = raw(url + "/", headers={"Accept": "text/html,*/*"})  # a browser: to the dashboard
    assert status == 200 and b"<title>Shoal status</title>" in page  # urllib followed the redirect
    status, listing = http(url + "/")  # anything else: the main routes
    assert status == 200 and "/v1/chat/completions" in listing["routes"]["openai"]
    assert listing["dashboard"] == "/dashboard"
    assert http(url + "/docs")[0] == http(url + "/robots.txt")[0] == 404  # answered, and in the access log


def test_dashboard_data_needs_the_api_key(gw_engine):
    with serve_in_thread(gw_engine, GATEWAY_ARGS.replace(api_key="sk-dash"), port=0) as server:
        status, page = http(server.url + "/dashboard")
        assert status == 200 and "<script>" in page  # the page holds no data: open, like /health
        assert http(server.url + "/dashboard/data")[0] == 401
        status, body = http(server.url + "/dashboard/data", headers={"Authorization": "Bearer sk-dash"})
        assert status == 200 and body["ready"]


def test_root_path_dashboard_errors_and_open_paths(gw_engine):
    """--root-path (a proxy that keeps the prefix): a route's own 404 under the prefix is an error on the
    dashboard, an unknown path's is not; /api (no slash) is GET / (open without a key), which sends a browser
    to the prefixed dashboard and lists prefixed routes."""
    key = {"Authorization": "Bearer sk-root"}
    site = open_site(SiteSpec(root_path="/api"))
    with serve_in_thread(gw_engine, GATEWAY_ARGS.replace(api_key="sk-root", admin_api_key="sk-adm"), port=0,
                         site=site) as server:
        assert http(server.url + "/api/v1/models/nope", headers=key)[0] == 404  # the route's: unknown model
        assert http(server.url + "/api/nope", headers=key)[0] == http(server.url + "/nope", headers=key)[0] == 404
        data = http(server.url + "/api/dashboard/data", headers=key)[1]
        assert [e["path"] for e in data["errors"]] == ["/api/v1/models/nope"] and data["errors_total"] == 1
        status, listing = http(server.url + "/api")  # no key: GET / is open in every form
        assert status == 200 and listing["dashboard"] == "/api/dashboard"
        assert "/api/v1/chat/completions" in listing["routes"]["openai"]
        for path in ("/api", "/api/", "/"):  # relative would take a browser at /api to /dashboard
            conn = HTTPConnection(urlsplit(server.url).netloc, timeout=10)
            conn.request("GET", path, headers={"Accept": "text/html"})
            answer = conn.getresponse()
            assert (answer.status, answer.getheader("Location")) == (302, "/api/dashboard"), path
            conn.close()
        assert http(server.url + "/api/dashboard")[0] == 200
        assert http(server.url + "/api/flush_cache", "POST", {}, headers=key)[0] == 401  # an operator route


def _browser():
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed "
                                     "(pip install playwright; its own browser download is not needed)")
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    return playwright.sync_playwright()


def test_dashboard_page_in_chromium(dash_url, tmp_path):
    with _browser() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        problems: list[str] = []
        page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        # An error whose message quotes markup a client sent: it must show as text, never as HTML.
        assert http(dash_url + "/v1/completions", "POST", {"model": "<b id=injected>x</b>", "prompt": "hi"})[0] == 404
        page.goto(dash_url + "/dashboard")
        page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=20_000)
        with _Load(dash_url):
            page.wait_for_function("parseFloat(document.getElementById('generation-tokens-per-s')"
                                   ".textContent.replace(/,/g, '')) > 0", timeout=30_000)
            before = {k: page.text_content(f"#{k}") for k in ("requests-total", "updates")}
            time.sleep(2.5)
            after = {k: page.text_content(f"#{k}") for k in ("requests-total", "updates")}
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        assert int(after["updates"]) >= int(before["updates"]) + 2  # polled every second
        assert after["requests-total"] != before["requests-total"]  # and the numbers moved
        modes = page.locator("#modes tr").all_text_contents()
        assert any(row.startswith("DECODE") for row in modes), modes
        assert "up" in page.text_content("#replicas")
        errors = page.text_content("#errors")
        assert "404" in errors and "<b id=injected>x</b>" in errors and page.locator("#injected").count() == 0
        browser.close()
    assert problems == []
