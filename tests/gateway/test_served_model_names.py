"""Several served names (vLLM's `--served-model-name a b c`): a request's `model` may be any of them (the
folder's own name is not one, as in vLLM), responses and metrics carry the first, /v1/models lists one card per
name (LoRA adapters after), and a 404 model_not_found lists them. The engine is built as `shoal serve` builds
it, from the same ServerArgs (its model_name is then the first name)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import msgspec
import pytest
from gw_helpers import GATEWAY_ARGS, http, sse_events

from runtime import Engine
from runtime.config import ServerArgs
from runtime.gateway.server import serve_in_thread
from runtime.gateway.state import GatewayState

ARGS = GATEWAY_ARGS.replace(served_model_name="a", served_model_aliases=("b", "c"))


@pytest.fixture(scope="module")
def url(tiny_llama) -> Iterator[str]:
    engine = Engine(server_args=ARGS.replace(model_path=str(tiny_llama), device="cpu", max_total_tokens=2048))
    try:
        with serve_in_thread(engine, ARGS, port=0) as handle:
            yield handle.url
    finally:
        engine.shutdown()


def test_every_name_is_served_and_responses_carry_the_first(url):
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    texts = set()
    for name in ("a", "b", "c", None):
        status, r = http(url + "/v1/completions", "POST", {**body, "model": name} if name else body)
        assert status == 200 and r["model"] == "a", r
        texts.add(r["choices"][0]["text"])
    assert len(texts) == 1  # the same model answers under each name
    status, raw = http(url + "/v1/chat/completions", "POST", {
        "model": "c", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True})
    events = [e for e in sse_events(raw) if e != "[DONE]"]
    assert status == 200 and events and {e["model"] for e in events} == {"a"}


def test_an_unknown_name_is_a_404_listing_the_served_ones(url):
    for route, body, name in (("/v1/completions", {"prompt": "x", "max_tokens": 1}, "d"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "d"),
                              ("/v1/completions", {"prompt": "x", "max_tokens": 1}, "llama")):  # the folder's
        status, r = http(url + route, "POST", {**body, "model": name})
        assert status == 404 and r["error"]["code"] == "model_not_found" and r["error"]["param"] == "model"
        assert "This server serves `a`, `b`, `c`." in r["error"]["message"]


def test_models_lists_one_card_per_name_then_the_adapters(url, monkeypatch):
    status, listed = http(url + "/v1/models")
    assert status == 200 and [c["id"] for c in listed["data"]] == ["a", "b", "c"]
    assert {(c["root"], c["max_model_len"], c["object"]) for c in listed["data"]} == \
        {("a", listed["data"][0]["max_model_len"], "model")}
    for name, card_id in (("b", "b"), ("c", "c"), ("a", "a")):
        status, card = http(f"{url}/v1/models/{name}")
        assert status == 200 and card["id"] == card_id
    status, r = http(url + "/v1/models/d")
    assert status == 404 and "`a`, `b`, `c`" in r["error"]["message"]
    # vLLM's order: the base names, then each adapter (its folder as root, the first name as parent)
    monkeypatch.setattr(GatewayState, "lora_adapters", property(lambda self: {"ad": "/p/ad"}))
    status, listed = http(url + "/v1/models")
    assert [(c["id"], c["root"], c.get("parent")) for c in listed["data"]] == [
        ("a", "a", None), ("b", "a", None), ("c", "a", None), ("ad", "/p/ad", "a")]
    status, r = http(url + "/v1/models/zz")
    assert status == 404 and "This server serves `a`, `b`, `c`, `ad`." in r["error"]["message"]


def test_metrics_label_the_first_name(url):
    status, text = http(url + "/metrics")
    assert status == 200 and 'model_name="a"' in text
    assert 'model_name="b"' not in text and 'model_name="c"' not in text


def test_the_names_travel_to_a_ray_actor():
    """The GatewayActor gets ServerArgs pickled (msgspec-encodable too): the names arrive as a tuple."""
    args = ServerArgs(served_model_name="a", served_model_aliases=["b", "c"])
    assert args.served_model_aliases == ("b", "c")
    assert pickle.loads(pickle.dumps(args)) == args
    assert msgspec.json.decode(msgspec.json.encode(args), type=ServerArgs) == args


@pytest.mark.parametrize("argv, names", [
    (["--config", "one.yaml", "--served-model-name", "a", "b"], ("a", ("b",))),  # the command line wins
    (["--config", "two.yaml", "--served-model-name", "c"], ("c", None)),  # YAML's y does not linger
    (["--served-model-name", "a", "b", "--served-model-name", "c"], ("c", None)),
    (["--served-model-name", "a", "--served-model-name", "c", "d"], ("c", ("d",))),
    (["--served-model-name", "a", "b", "--served-model-name=c"], ("c", None)),
    (["--served-model-name", "a", "b", "c", "--seed", "1"], ("a", ("b", "c"))),
])
def test_the_last_served_model_name_wins_whole(argv, names, tmp_path, monkeypatch):
    """As argparse keeps vLLM's nargs="+" list: the last occurrence, all of its names, and nothing of any
    earlier one (--config's YAML flags come first)."""
    from runtime.cli import build_parser, server_args
    from runtime.vllm_argv import vllm_values

    (tmp_path / "one.yaml").write_text("served-model-name: x\n")
    (tmp_path / "two.yaml").write_text("served-model-name: [x, y]\n")
    monkeypatch.chdir(tmp_path)
    args = server_args(build_parser().parse_args(vllm_values(["serve", "/m", *argv])))
    assert (args.served_model_name, args.served_model_aliases) == names
