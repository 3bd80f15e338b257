"""Hostile pair sizes on /score and /rerank (the pair routes of a 1-label classifier server, the tiny Llama
reward model of tests/classify): a text certainly past the context is a 400 context_length_exceeded naming it
(query, documents[i], text_1, text_2[i]) before any pair is encoded, more pairs than the server could ever run
are refused before encoding, normal pairs score as Engine.score scores them, and a large body is encoded on
the tokenizer's worker thread while /health answers."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gw_helpers import http

from runtime import Engine, ServerArgs
from runtime.gateway.server import serve_in_thread

sys.path.insert(0, str(Path(__file__).parents[1] / "classify"))
from classify_models import ENGINE_KWARGS, classifier_copy  # noqa: E402

QUERY = "The capital of France is Paris."
DOCS = ["Paris is the capital of France.", "Hello", "The quick brown fox jumps over the lazy dog.", "emoji: 🙂"]
HUGE = "x" * 2_000_000  # the tiny model's reach bounds 512 tokens at 6,656 characters


class _PairSpy:
    """Stands in for the tokenizer's hf: records each pair encode's (thread, characters), sleeping `delay`
    seconds in the first one of more than 500 characters; everything else goes to the real one."""

    def __init__(self, real: Any, delay: float = 0.0):
        self.real, self.delay = real, delay
        self.calls: list[tuple[str, int]] = []

    def __call__(self, text: str, text_pair: str | None = None, **kwargs: Any) -> Any:
        chars = len(text) + len(text_pair or "")
        self.calls.append((threading.current_thread().name, chars))
        if chars > 500 and self.delay:
            time.sleep(self.delay)
            self.delay = 0.0
        return self.real(text=text, text_pair=text_pair, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def __deepcopy__(self, memo: dict) -> Any:  # the truncating copy (Tokenizer.truncating_hf): the real one's
        import copy

        return copy.deepcopy(self.real, memo)


@pytest.fixture(scope="module")
def scorer(tiny_llama, tmp_path_factory) -> Iterator[Engine]:
    engine = Engine(str(classifier_copy(tiny_llama, tmp_path_factory.mktemp("scorer") / "llama", None)),
                    is_embedding=True, **ENGINE_KWARGS)
    tok = engine.tokenizer
    assert tok.reach is not None  # made now, from the real hf, not a spy
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(scorer) -> Iterator[str]:
    """The scorer behind a gateway that takes 16 MB bodies and queues at most 128 requests."""
    with serve_in_thread(scorer, ServerArgs(max_request_bytes=16 << 20, max_waiting_requests=128),
                         port=0) as handle:
        yield handle.url


@pytest.fixture()
def spy(scorer, monkeypatch) -> _PairSpy:
    made = _PairSpy(scorer.tokenizer.hf)
    monkeypatch.setattr(scorer.tokenizer, "hf", made)
    return made


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/rerank", {"query": HUGE, "documents": ["d"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["d", HUGE]}, "documents[1]"),
    ("/score", {"text_1": HUGE, "text_2": ["a", "b"]}, "text_1"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["b", HUGE]}, "text_2[1]"),
])
def test_past_the_context_is_refused_without_encoding(url, spy, path, body, param):
    t = time.monotonic()
    status, r = http(url + path, "POST", body)
    assert status == 400, r
    assert r["error"]["code"] == "context_length_exceeded" and r["error"]["param"] == param, r
    assert f"{param} has 2000000 characters" in r["error"]["message"]
    assert spy.calls == []
    assert time.monotonic() - t < 5


def test_pair_count_is_capped_before_encoding(url, spy):
    status, r = http(url + "/v2/rerank", "POST", {"query": "q", "documents": ["d"] * 129})
    assert status == 400 and r["error"]["param"] == "documents" and "129 pairs" in r["error"]["message"], r
    assert "--max-waiting-requests" in r["error"]["message"]
    status, r = http(url + "/score", "POST", {"text_1": "q", "text_2": ["d"] * 100_000})
    assert status == 400 and r["error"]["param"] == "text_2", r
    assert spy.calls == []
    status, r = http(url + "/score", "POST", {"text_1": "q", "text_2": ["d"] * 128})
    assert status == 200 and len(r["data"]) == 128, r


def test_normal_pairs_score_as_before(url, scorer, spy):
    want = scorer.score(QUERY, DOCS)
    status, r = http(url + "/v1/score", "POST", {"text_1": QUERY, "text_2": DOCS})
    assert status == 200, r
    assert [d["score"] for d in r["data"]] == pytest.approx([o.outputs.score for o in want], abs=1e-6)
    assert r["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in want)
    status, r = http(url + "/rerank", "POST", {"query": QUERY, "documents": DOCS})
    assert status == 200, r
    assert {x["index"]: x["relevance_score"] for x in r["results"]} == pytest.approx(
        {i: o.outputs.score for i, o in enumerate(want)}, abs=1e-6)
    assert all(not name.startswith("shoal-tokenize") for name, _ in spy.calls)  # a small body stays on the loop
    # A text past the context as characters is kept under truncate_prompt_tokens (cut after encoding)
    cut = scorer.score(QUERY, "ab " * 3000, truncate_prompt_tokens=9)
    status, r = http(url + "/score", "POST", {"text_1": QUERY, "text_2": "ab " * 3000, "truncate_prompt_tokens": 9})
    assert status == 200 and r["usage"]["prompt_tokens"] == 9, r
    assert r["data"][0]["score"] == pytest.approx(cut[0].outputs.score, abs=1e-6)


def test_large_body_is_encoded_off_the_loop(url, scorer, monkeypatch):
    """A slow encode of a large rerank body runs while /health answers at once."""
    slow = _PairSpy(scorer.tokenizer.hf, delay=1.0)
    monkeypatch.setattr(scorer.tokenizer, "hf", slow)
    # ~90 KB; each pair ~480 tokens, inside the context (512): this tokenizer makes ~2 characters a token
    docs = [f"{i}: " + "The quick brown fox jumps over the lazy dog. " * 19 for i in range(100)]
    out: dict[str, Any] = {}
    big = threading.Thread(target=lambda: out.setdefault("r", http(url + "/rerank", "POST",
                                                                   {"query": QUERY, "documents": docs})))
    big.start()
    time.sleep(0.3)
    t = time.monotonic()
    assert http(url + "/health")[0] == 200
    assert time.monotonic() - t < 0.5  # not behind the 1 s encode
    big.join()
    status, r = out["r"]
    assert status == 200 and len(r["results"]) == 100, r
    assert slow.calls and all(name.startswith("shoal-tokenize") for name, _ in slow.calls)
