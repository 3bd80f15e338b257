"""--api-key as vLLM's and SGLang's take it: several keys (any one authorizes), vLLM's $VLLM_API_KEY when the
command line gives none, every /health* path and every OPTIONS request open (SGLang's and vLLM's checks), the
keys logged as a count only, and kept by the ServerArgs a Ray gateway actor gets; SGLang's --admin-api-key (the
operator routes take it and no other key). CORS as vLLM's flags ask:
JSON-list origins, --allowed-methods / --allowed-headers / --allow-credentials honoured in preflights and
answers, and a value no browser could match refused by name."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterator

import openai
import pytest
from gw_helpers import GATEWAY_ARGS, http, raw
from log_lines import LogLines

from runtime.cli import build_parser, server_args
from runtime.config import ServerArgs
from runtime.errors import ServerArgsError
from runtime.gateway.server import serve_in_thread
from runtime.vllm_argv import vllm_values

KEYS = ("sk-one", "sk-two")


@pytest.fixture
def gateway_lines() -> Iterator[LogLines]:
    lines, log = LogLines(logging.INFO), logging.getLogger("shoal.gateway")
    level = log.level
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    yield lines
    log.removeHandler(lines)
    log.setLevel(level)


def _serve(*argv: str) -> ServerArgs:
    return server_args(build_parser().parse_args(vllm_values(["serve", *argv])))


def test_several_keys_any_one_authorizes(gw_engine, gateway_lines):
    with serve_in_thread(gw_engine, GATEWAY_ARGS.replace(api_key=KEYS), port=0) as server:
        for key in KEYS:  # each key serves a real completion
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
            r = client.completions.create(model="llama", prompt="hi", max_tokens=2, temperature=0)
            assert r.usage.completion_tokens >= 1
        for header in ({}, {"Authorization": "Bearer sk-three"}, {"Authorization": "Bearer sk-one sk-two"},
                       {"Authorization": "Basic sk-one"}):
            status, body = http(server.url + "/v1/models", headers=header)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", header
        # SGLang leaves every /health* path open: /health_generate runs a real one-token generation.
        assert http(server.url + "/health_generate") == (200, {"status": "ok"})
        assert http(server.url + "/health")[0] == 200
        # What a browser asks for on its own (no key to send): the favicon and the index, which hold no data
        assert raw(server.url + "/favicon.ico")[0] == 200 and http(server.url + "/")[0] == 200
        # Any OPTIONS passes the key check (vLLM, SGLang): not a preflight, so the router's 405.
        status, _, _ = raw(server.url + "/v1/completions", "OPTIONS")
        assert status == 405
    joined = "\n".join(gateway_lines.messages)
    assert "API key required (2 keys set)" in joined and not any(k in joined for k in KEYS)


def test_preflight_without_key_with_cors_off_is_not_a_401(gw_engine):
    args = GATEWAY_ARGS.replace(api_key=KEYS, allowed_origins="")
    with serve_in_thread(gw_engine, args, port=0) as server:
        status, headers, _ = raw(server.url + "/v1/chat/completions", "OPTIONS", {
            "Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
        assert status == 405 and "Access-Control-Allow-Origin" not in headers


def test_a_cached_repo_id_after_the_keys_is_model(monkeypatch, tmp_path):
    """`--api-key KEY Org/Name` (vLLM's form) serves the repo from the HF cache, as a folder there would be:
    the word is MODEL, not a second key; one written as Org/Name that the cache lacks is refused, naming
    the cache (the default model would be served otherwise); other words stay keys."""
    hub = tmp_path / "hub"
    for repo in ("models--Org--Tiny", "models--gpt2"):
        (hub / repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "VLLM_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    for model in ("Org/Tiny", "gpt2"):
        args = _serve("--api-key", "sk-1", model)
        assert args.model_path == model and args.api_key == ("sk-1",)
    with pytest.raises(ServerArgsError, match=f"'Org/Absent' looks like a Hugging Face repo id.*{hub}") as info:
        _serve("--api-key", "sk-1", "Org/Absent")
    assert info.value.flag == "--api-key"
    for keys in (("sk-1", "sk-2"), ("sk-1", "ab+c/d=="), ("sk-1", "x/y/z")):  # no Org/Name: keys as typed
        assert _serve("--api-key", *keys).api_key == keys and _serve("--api-key", *keys).model_path is None


def test_keys_from_the_command_line_and_vllm_env(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert _serve("--api-key", "k1", "k2").api_key == ("k1", "k2")  # the default model: every word a key
    assert _serve("/m", "--api-key", "k1", "k2").api_key == ("k1", "k2")
    args = _serve("--api-key", "k1", str(tmp_path))  # `--api-key KEY MODEL` keeps its meaning
    assert args.api_key == ("k1",) and args.model_path == str(tmp_path)
    with pytest.raises(ServerArgsError, match="looks like a model folder") as info:
        _serve("--api-key", "k1", str(tmp_path / "typo"))
    assert info.value.flag == "--api-key"
    assert _serve().api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert _serve().api_key == ("from-env",)
    assert _serve("--api-key", "cli").api_key == ("cli",)  # the flag wins, as in vLLM
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert _serve().api_key is None  # empty is unset (vLLM filters it out)


@pytest.mark.parametrize("bad", ["", " k", "k\n", [], ["k", ""], 5])
def test_a_key_that_could_never_be_sent_is_refused(bad):
    with pytest.raises(ServerArgsError) as info:
        ServerArgs(api_key=bad)
    assert info.value.flag == "--api-key"


def test_keys_travel_to_a_ray_gateway_actor():
    """Ray pickles the ServerArgs it hands GatewayActor: the keys arrive as given."""
    args = ServerArgs(api_key=["a", "b", "a"])
    assert args.api_key == ("a", "b")
    assert pickle.loads(pickle.dumps(args)).api_key == ("a", "b")


def test_cors_flags_as_vllm_gives_them(gw_engine):
    args = GATEWAY_ARGS.replace(allowed_origins='["https://UI.example/"]', allowed_methods='["POST"]',
                                allowed_headers='["Authorization", "X-Trace"]', allow_credentials=True)
    with serve_in_thread(gw_engine, args, port=0) as server:
        url = server.url + "/v1/completions"
        ask = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, x-trace, content-type"}
        status, headers, _ = raw(url, "OPTIONS", ask)
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "https://ui.example"
        assert headers["Access-Control-Allow-Credentials"] == "true" and headers["Access-Control-Allow-Methods"] == "POST"
        assert {"authorization", "x-trace", "content-type"} <= set(headers["Access-Control-Allow-Headers"].split(", "))
        for change, code in (({"Access-Control-Request-Method": "PUT"}, "cors_method_not_allowed"),
                             ({"Access-Control-Request-Headers": "x-other"}, "cors_headers_not_allowed"),
                             ({"Origin": "https://evil.example"}, "cors_origin_not_allowed")):
            status, _, body = raw(url, "OPTIONS", {**ask, **change})
            assert status == 403 and code.encode() in body, change
        status, headers, _ = raw(url, "POST", {"Origin": "https://ui.example", "Content-Type": "application/json"},
                                 b'{"prompt": "hi", "max_tokens": 2}')
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://ui.example"
        assert headers["Access-Control-Allow-Credentials"] == "true" and "Origin" in headers["Vary"]
        for other in ("https://evil.example", "null"):  # a credentialed answer no other page may read
            status, headers, _ = raw(server.url + "/v1/models", headers={"Origin": other, "Cookie": "session=1"})
            assert status == 200 and not any(h.startswith("Access-Control") for h in headers), other
            status, headers, _ = raw(url, "OPTIONS", {**ask, "Origin": other})
            assert status == 403 and "Access-Control-Allow-Origin" not in headers, other


@pytest.mark.parametrize("origins", ["*", '["*"]', "null", "https://ui.example,null"])
def test_credentials_for_any_origin_are_refused_at_start(origins):
    """'*' (the default) or "null" (any sandboxed page's) with --allow-credentials: every site could send
    requests with a visitor's cookies or client certificate and read the answers (Starlette, so vLLM, echoes
    any origin): refused, naming the flag and the fix, before anything loads (the CLI, Engine kwargs)."""
    from runtime.gateway.cors import Cors

    argv = ["--allow-credentials"] + (["--allowed-origins", origins] if origins != "*" else [])
    for start in (lambda: _serve(*argv), lambda: ServerArgs(allowed_origins=origins, allow_credentials=True),
                  lambda: Cors(("*",) if "*" in origins else ("null",), credentials=True)):
        with pytest.raises(ServerArgsError, match="list the page origins|--allowed-origins https://") as info:
            start()
        assert info.value.flag == "--allow-credentials"
    assert ServerArgs(allowed_origins=origins).allow_credentials is False  # without credentials: as before


@pytest.mark.parametrize(("kwargs", "flag", "says"), [
    ({"allowed_origins": '["https://a.com/path"]'}, "--allowed-origins", "is not an origin"),
    ({"allowed_origins": "a.com"}, "--allowed-origins", "is not an origin"),
    ({"allowed_origins": '["https://a.com"'}, "--allowed-origins", "is not valid JSON"),
    ({"allowed_origins": "[1]"}, "--allowed-origins", "JSON list of strings"),
    ({"allowed_methods": "[]"}, "--allowed-methods", "names no method"),
    ({"allowed_headers": "x trace"}, "--allowed-headers", "is not a header name"),
])
def test_cors_values_no_browser_could_match_are_refused(kwargs, flag, says):
    with pytest.raises(ServerArgsError, match=says) as info:
        ServerArgs(**kwargs)
    assert info.value.flag == flag


def test_cors_lists_in_either_form():
    assert ServerArgs(allowed_origins=["https://a.com", "https://b.com"]) == \
        ServerArgs(allowed_origins='["https://a.com", "https://b.com"]')  # Engine(...) / YAML lists
    assert _serve("--allowed-origins", '["https://a.com"]').allowed_origins == '["https://a.com"]'


def test_admin_key_alone_opens_the_operator_routes(gw_engine, gateway_lines):
    """SGLang's --admin-api-key beside --api-key: the operator routes take the admin key and refuse every
    inference key; the other routes take the inference keys only; /health stays open."""
    args = GATEWAY_ARGS.replace(api_key=KEYS, admin_api_key="sk-admin")
    with serve_in_thread(gw_engine, args, port=0) as server:
        def call(path: str, key: str | None, method: str = "POST") -> tuple[int, object]:
            return http(server.url + path, method, {} if method == "POST" else None,
                        {"Authorization": f"Bearer {key}"} if key else {})

        for path in ("/flush_cache", "/pause_generation", "/abort_request", "/v1/load_lora_adapter",
                     "/update_weights_from_disk", "/init_weights_update_group", "/sleep", "/wake_up"):
            for key in (*KEYS, None, "sk-wrong"):
                status, body = call(path, key)
                assert status == 401 and "--admin-api-key" in body["error"]["message"], (path, key)
        assert call("/flush_cache", "sk-admin")[0] == 200
        assert call("/abort_request", "sk-admin")[0] != 401  # a 400 naming rid: past the key check
        assert call("/v1/models", "sk-one", "GET")[0] == 200
        assert call("/v1/models", "sk-admin", "GET")[0] == 401  # SGLang: not an inference key
        assert call("/health", None, "GET")[0] == 200
        status, info = call("/get_server_info", "sk-one", "GET")
        assert status == 200 and "sk-admin" not in str(info) and "admin_api_key" not in info
    joined = "\n".join(gateway_lines.messages)
    assert "admin key set (--admin-api-key)" in joined and "sk-admin" not in joined


def test_admin_key_without_api_keys_guards_the_operator_routes_only(gw_engine):
    with serve_in_thread(gw_engine, GATEWAY_ARGS.replace(admin_api_key="sk-admin"), port=0) as server:
        assert http(server.url + "/v1/models")[0] == 200
        assert http(server.url + "/flush_cache", "POST", {})[0] == 401
        assert http(server.url + "/flush_cache", "POST", {}, {"Authorization": "Bearer sk-admin"})[0] == 200
    with serve_in_thread(gw_engine, GATEWAY_ARGS.replace(api_key=KEYS), port=0) as server:  # --api-key only
        assert http(server.url + "/flush_cache", "POST", {}, {"Authorization": "Bearer sk-two"})[0] == 200
        assert http(server.url + "/flush_cache", "POST", {})[0] == 401


def test_every_admin_path_is_a_route():
    from runtime.gateway.api_keys import ADMIN_PATHS
    from runtime.gateway.app import build_app

    routes = {r.resource.canonical for r in build_app(lambda: None, GATEWAY_ARGS).router.routes()}
    assert ADMIN_PATHS <= routes, ADMIN_PATHS - routes


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"api_key": ("k1", "k2"), "admin_api_key": "k2"}, "equals an --api-key"),
    ({"admin_api_key": ""}, "non-empty"),
    ({"admin_api_key": " adm"}, "whitespace"),
    ({"admin_api_key": ["a", "b"]}, "one key"),
])
def test_a_bad_admin_key_is_refused(kwargs, says):
    with pytest.raises(ServerArgsError, match=says) as info:
        ServerArgs(**kwargs)
    assert info.value.flag == "--admin-api-key"
    assert _serve("--admin-api-key", "adm").admin_api_key == "adm"
