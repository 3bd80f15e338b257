"""CORS (--allowed-origins): preflights answered without the API key, Access-Control-Allow-Origin on every
answer to an allowed origin (errors and SSE streams too), nothing for a disallowed one or with CORS off;
and OpenAI's GET /v1/models/{model} (names with '/'; 404 model_not_found for any other name)."""

from __future__ import annotations

from gw_helpers import GATEWAY_ARGS, http, raw

from runtime.gateway.server import serve_in_thread

PREFLIGHT = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}


def test_preflight_and_responses_carry_cors_headers_by_default(gw_url):
    status, headers, _ = raw(gw_url + "/v1/chat/completions", "OPTIONS", {
        **PREFLIGHT, "Access-Control-Request-Headers": "content-type, x-stainless-os"})
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    allowed = {h.strip().lower() for h in headers["Access-Control-Allow-Headers"].split(",")}
    assert {"authorization", "content-type", "x-stainless-os"} <= allowed

    origin = {"Origin": "http://example.com", "Content-Type": "application/json"}
    status, headers, _ = raw(gw_url + "/v1/models", headers=origin)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    assert "Retry-After" in headers["Access-Control-Expose-Headers"]
    status, headers, _ = raw(gw_url + "/v1/completions", "POST", origin, b'{"prompt": "hi", "max_tokens": -1}')
    assert status == 400 and headers["Access-Control-Allow-Origin"] == "*"  # an error too
    status, headers, _ = raw(gw_url + "/no/such/route", headers=origin)
    assert status == 404 and headers["Access-Control-Allow-Origin"] == "*"
    status, headers, body = raw(gw_url + "/v1/completions", "POST", origin,
                                b'{"prompt": "hi", "max_tokens": 3, "stream": true}')
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert headers["Access-Control-Allow-Origin"] == "*" and body.rstrip().endswith(b"data: [DONE]")
    status, headers, _ = raw(gw_url + "/v1/models")  # no Origin: not a cross-origin call, nothing added
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_listed_origins_with_api_key(gw_engine):
    args = GATEWAY_ARGS.replace(api_key="sk-test", allowed_origins="http://ui.example:8080, https://b.example/")
    with serve_in_thread(gw_engine, args, port=0) as server:
        url = server.url + "/v1/completions"
        # The browser sends no Authorization on a preflight: it must not be a 401.
        ok = {"Origin": "http://ui.example:8080", "Access-Control-Request-Method": "POST",
              "Access-Control-Request-Headers": "authorization,content-type"}
        status, headers, _ = raw(url, "OPTIONS", ok)
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://ui.example:8080"
        assert "Origin" in headers["Vary"]
        status, headers, _ = raw(url, "OPTIONS", {**ok, "Origin": "https://b.example"})
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "https://b.example"
        status, headers, _ = raw(url, "OPTIONS", {**ok, "Origin": "http://evil.example"})
        assert status == 403 and not any(h.startswith("Access-Control-Allow") for h in headers)
        # The real request still needs the key; its 401 carries CORS so the page can read why.
        status, headers, _ = raw(url, "POST", {"Origin": "http://ui.example:8080"}, b'{"prompt": "hi"}')
        assert status == 401 and headers["Access-Control-Allow-Origin"] == "http://ui.example:8080"
        auth = {"Origin": "http://ui.example:8080", "Authorization": "Bearer sk-test",
                "Content-Type": "application/json"}
        status, headers, _ = raw(url, "POST", auth, b'{"prompt": "hi", "max_tokens": 2}')
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://ui.example:8080"
        status, headers, _ = raw(url, "POST", {**auth, "Origin": "http://evil.example"},
                                 b'{"prompt": "hi", "max_tokens": 2}')
        assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_cors_off(gw_engine):
    with serve_in_thread(gw_engine, GATEWAY_ARGS.replace(allowed_origins=""), port=0) as server:
        status, headers, _ = raw(server.url + "/v1/chat/completions", "OPTIONS", PREFLIGHT)
        assert status == 405 and "Access-Control-Allow-Origin" not in headers
        status, headers, _ = raw(server.url + "/v1/models", headers={"Origin": "http://example.com"})
        assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_retrieve_model(gw_url):
    status, listed = http(gw_url + "/v1/models")
    status, card = http(gw_url + "/v1/models/llama")
    assert status == 200 and card == listed["data"][0]
    status, body = http(gw_url + "/v1/models/gpt-4")
    assert status == 404 and body["error"]["code"] == "model_not_found" and "llama" in body["error"]["message"]
    status, body = http(gw_url + "/v1/models/llama/extra")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_retrieve_model_with_slash_in_its_name(gw_engine):
    import openai

    args = GATEWAY_ARGS.replace(served_model_name="org/tiny-llama")
    with serve_in_thread(gw_engine, args, port=0) as server:
        status, card = http(server.url + "/v1/models/org/tiny-llama")
        assert status == 200 and card["id"] == "org/tiny-llama" and card["object"] == "model"
        assert card["root"] == "llama"
        status, escaped = http(server.url + "/v1/models/org%2Ftiny-llama")
        assert status == 200 and escaped == card
        status, _ = http(server.url + "/v1/models/llama")  # the model's own name is accepted as everywhere
        assert status == 200
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.models.retrieve("org/tiny-llama").id == "org/tiny-llama"
        try:
            client.models.retrieve("org/other")
            raise AssertionError("an unknown model must be a 404")
        except openai.NotFoundError as e:
            assert e.body["code"] == "model_not_found"
