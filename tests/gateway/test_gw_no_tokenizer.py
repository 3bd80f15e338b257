"""A model folder without tokenizer files (benchmarks: config.json + dummy weights) serves token-id
requests; text and chat get a clear 400 instead of a 500."""

from __future__ import annotations

import shutil

import pytest
from gw_helpers import GATEWAY_ARGS, http

from runtime import Engine
from runtime.gateway.server import serve_in_thread


@pytest.fixture(scope="module")
def bare_url(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bare_model")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama / name, folder / name)
    engine = Engine(str(folder), device="cpu", max_total_tokens=1024)
    handle = serve_in_thread(engine, GATEWAY_ARGS, port=0)
    yield handle.url
    handle.stop()
    engine.shutdown()


def test_token_ids_work_without_a_tokenizer(bare_url):
    status, body = http(bare_url + "/v1/completions", "POST", {"prompt": [5, 6, 7], "max_tokens": 4,
                                                                "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["text"] == ""
    status, body = http(bare_url + "/generate", "POST", {"input_ids": [5, 6, 7],
                                                         "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and len(body["output_ids"]) == 3, body
    assert http(bare_url + "/health_generate")[0] == 200


def test_text_and_chat_are_a_clear_400_without_a_tokenizer(bare_url):
    status, body = http(bare_url + "/v1/completions", "POST", {"prompt": "hello", "max_tokens": 4})
    assert status == 400 and "no tokenizer" in body["error"]["message"], body
    status, body = http(bare_url + "/v1/chat/completions", "POST",
                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert status == 400 and "no tokenizer" in body["error"]["message"], body
