"""A grammar whose output must end while min_tokens still blocks EOS: the row has no token left, which is
the request's own conflict, so a 400 naming min_tokens (the usual error event in a stream), KV freed."""

from __future__ import annotations

import pytest
from gw_helpers import generation_error, http, wait_kv_full

from runtime.managers.grammar_manager import GrammarManager
from runtime.managers.req import Req
from runtime.sampling.params import SamplingParams

MODEL = "llama"


@pytest.mark.parametrize("stream", [False, True])
def test_grammar_ending_before_min_tokens_is_a_400_naming_min_tokens(gw_url, gw_engine, stream):
    pytest.importorskip("xgrammar")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "min_tokens": 6, "temperature": 0,
            "guided_regex": "a", "stream": stream}
    err = generation_error(gw_url + "/v1/completions", body)
    assert err["param"] == "min_tokens" and err["type"] == "invalid_request_error", err
    assert "grammar ends before min_tokens (6)" in err["message"], err
    wait_kv_full(gw_engine)


def test_grammar_within_min_tokens_still_succeeds(gw_url):
    pytest.importorskip("xgrammar")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "min_tokens": 1, "temperature": 0,
            "guided_regex": "a"}
    status, r = http(gw_url + "/v1/completions", "POST", body)
    assert status == 200, r
    assert r["choices"][0]["text"] == "a"


class _Refusing:
    """A grammar matcher stub that takes no token (its only way on was EOS, which min_tokens masked)."""

    def accept_token(self, token: int) -> bool:
        return False

    def is_terminated(self) -> bool:
        return False


@pytest.mark.parametrize(("outputs", "param"), [(1, "min_tokens"), (3, "min_tokens"), (4, None)])
def test_a_rejection_names_min_tokens_only_while_it_blocked_eos(outputs, param):
    req = Req("r", [1], SamplingParams.from_dict({"regex": "x", "min_new_tokens": 3, "max_new_tokens": 8}), 0,
              frozenset())
    req.grammar = _Refusing()
    req.output_ids = [9] * outputs  # the sampled token is already the last output when the matcher sees it
    GrammarManager.accept(req, 9)
    fr = req.finish_reason
    assert fr.kind == "error" and fr.param == param
    assert ("ends before min_tokens (3)" in fr.message) == (param is not None), fr.message
