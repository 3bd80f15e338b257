"""SGLang's /generate fields: sampling_params.sampling_seed (seed's other name), logprob_start_len with
return_logprob (meta_info input_token_logprobs / input_top_logprobs from that position on, the first null,
checked against HF transformers' log_softmax over the same tiny Llama), sampling_params.n (a list, prompt by
prompt, choice j sampling with seed + j), and the /v1/tokenize, /v1/detokenize paths SGLang serves."""

from __future__ import annotations

from typing import Any

import pytest
from gw_helpers import http

from runtime.errors import InvalidRequestError
from runtime.sampling.params import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog"
GREEDY = {"temperature": 0, "max_new_tokens": 2}
SAMPLED = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}


def _generate(url: str, body: dict[str, Any], status: int = 200) -> Any:
    got, r = http(url + "/generate", "POST", body)
    assert got == status, r
    return r


def test_sampling_seed_is_seed(gw_url):
    by_seed = _generate(gw_url, {"text": PROMPT, "sampling_params": {**SAMPLED, "seed": 11}})
    by_alias = _generate(gw_url, {"text": PROMPT, "sampling_params": {**SAMPLED, "sampling_seed": 11}})
    other = _generate(gw_url, {"text": PROMPT, "sampling_params": {**SAMPLED, "sampling_seed": 12}})
    assert by_alias["output_ids"] == by_seed["output_ids"] != other["output_ids"]
    r = _generate(gw_url, {"text": PROMPT, "sampling_params": {**SAMPLED, "seed": 1, "sampling_seed": 2}}, 400)
    assert r["error"]["param"] == "sampling_seed"
    assert SamplingParams.from_dict({"seed": 3, "sampling_seed": 3}).seed == 3  # the same value twice is fine
    with pytest.raises(InvalidRequestError):
        SamplingParams.from_dict({"sampling_seed": -1})


def test_input_logprobs_match_hf(gw_url, gw_engine, hf_rows):
    ids = gw_engine.tokenizer.encode(PROMPT)
    ref = hf_rows(ids)
    for start, top_n in ((0, 2), (3, 0)):
        r = _generate(gw_url, {"text": PROMPT, "sampling_params": GREEDY, "return_logprob": True,
                               "logprob_start_len": start, "top_logprobs_num": top_n})
        meta = r["meta_info"]
        lps = meta["input_token_logprobs"]
        assert [t for _, t in lps] == ids[start:] and lps[0][0] is None  # SGLang's: the first one null
        for i, (lp, t) in enumerate(lps[1:], start=start + 1):
            assert lp == pytest.approx(float(ref[i - 1][t]), abs=1e-4)
        if not top_n:
            assert "input_top_logprobs" not in meta
            continue
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(lps) and tops[0] is None
        for i, step in enumerate(tops[1:], start=start + 1):
            want = ref[i - 1].topk(top_n)
            assert [t for _, t in step] == want.indices.tolist()
            assert [lp for lp, _ in step] == pytest.approx(want.values.tolist(), abs=1e-4)
    # The default start (-1) is the prompt's last token, nothing to score; return_text_in_logprobs names tokens
    r = _generate(gw_url, {"text": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 1,
                           "return_text_in_logprobs": True})
    tok = gw_engine.tokenizer.id_to_token_text
    assert r["meta_info"]["input_token_logprobs"] == [[None, ids[-1], tok(ids[-1])]]
    assert r["meta_info"]["input_top_logprobs"] == [None]
    assert len(r["meta_info"]["output_token_logprobs"][0]) == 3
    plain = _generate(gw_url, {"text": PROMPT, "sampling_params": GREEDY})
    assert "input_token_logprobs" not in plain["meta_info"]  # only with return_logprob, as before


@pytest.mark.parametrize("start", [-2, 9])
def test_logprob_start_len_out_of_range_is_a_400(gw_url, start):
    r = _generate(gw_url, {"input_ids": [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6, 7, 8, 9]], "sampling_params": GREEDY,
                           "return_logprob": True, "logprob_start_len": start}, 400)
    assert r["error"]["param"] == "logprob_start_len"


def test_n_choices_come_as_a_list(gw_url):
    sampled = {**SAMPLED, "seed": 7}
    outs = _generate(gw_url, {"text": [PROMPT, "Hello"], "sampling_params": {**sampled, "n": 2},
                              "return_logprob": True, "logprob_start_len": 0})
    assert len(outs) == 4
    alone = [_generate(gw_url, {"text": text, "sampling_params": {**SAMPLED, "seed": seed}})
             for text in (PROMPT, "Hello") for seed in (7, 8)]
    assert [o["output_ids"] for o in outs] == [a["output_ids"] for a in alone]  # prompt by prompt, seed + j
    base = outs[0]["meta_info"]["id"].rsplit("-", 1)[0]
    assert [o["meta_info"]["id"] for o in outs] == [f"{base}-{k}" for k in range(4)]
    # The n choices of a prompt share its one scoring
    assert outs[0]["meta_info"]["input_token_logprobs"] == outs[1]["meta_info"]["input_token_logprobs"]
    single = _generate(gw_url, {"text": PROMPT, "sampling_params": {**sampled, "n": 1}})
    assert isinstance(single, dict) and single["output_ids"] == alone[0]["output_ids"]
    for bad in (0, 5, "2", True):
        r = _generate(gw_url, {"text": PROMPT, "sampling_params": {**sampled, "n": bad}}, 400)
        assert r["error"]["param"] == "sampling_params.n", r
    r = _generate(gw_url, {"text": PROMPT, "sampling_params": {**sampled, "n": 2}, "stream": True}, 400)
    assert r["error"]["param"] == "stream"


def test_v1_tokenize_paths(gw_url):
    for path in ("/tokenize", "/detokenize"):
        body = {"prompt": PROMPT} if path == "/tokenize" else {"tokens": [5, 6, 7]}
        assert http(gw_url + "/v1" + path, "POST", body) == http(gw_url + path, "POST", body)
    status, r = http(gw_url + "/v1/tokenize", "POST", {"prompt": PROMPT})
    assert status == 200 and r["count"] == len(r["tokens"]) > 0


def test_no_stop_trim_and_custom_logit_processor(gw_url):
    """SGLang's sampling_params.no_stop_trim is include_stop_str_in_output (it had been an unknown parameter);
    a top-level custom_logit_processor is a 400, as on chat and completions (it had been ignored) (review)."""
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    status, r = http(gw_url + "/generate", "POST", {"text": PROMPT, "sampling_params": sp})
    assert status == 200, r
    stop = next(ch for ch in r["text"] if ch.isascii() and ch.isprintable() and not ch.isspace())  # one it holds
    trimmed, kept, explicit = (http(gw_url + "/generate", "POST", {"text": PROMPT, "sampling_params": {
        **sp, "stop": [stop], **extra}})[1]["text"] for extra in ({}, {"no_stop_trim": True},
                                                                  {"include_stop_str_in_output": True}))
    assert kept == explicit != trimmed and len(kept) > len(trimmed)
    status, r = http(gw_url + "/generate", "POST", {"text": PROMPT, "sampling_params": {
        **sp, "no_stop_trim": True, "include_stop_str_in_output": False}})
    assert status == 400 and r["error"]["param"] == "no_stop_trim"
    status, r = http(gw_url + "/generate", "POST", {"text": PROMPT, "sampling_params": sp,
                                                     "custom_logit_processor": "{}"})
    assert status == 400 and r["error"]["param"] == "custom_logit_processor"
