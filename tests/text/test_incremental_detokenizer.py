"""IncrementalDetokenizer on the tiny byte-level BPE tokenizer: multi-byte characters split across tokens
never come out broken, leading spaces survive, and stop strings are held back while partial, then dropped."""

from __future__ import annotations

import random

import pytest

from runtime.text.detokenizer import IncrementalDetokenizer
from runtime.text.tokenizer import Tokenizer

MULTIBYTE = "Émile a mangé une crème brûlée à Zürich. 日本語のテキストも少し。 emoji: 🙂🚀 fin"


@pytest.fixture(scope="module")
def tok(tiny_llama) -> Tokenizer:
    return Tokenizer(tiny_llama)


def feed(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int] | None = None,
         finish: bool = True) -> list[str]:
    """Adds ids in pieces of the given sizes (default one at a time); returns every delta."""
    sizes = sizes or [1] * len(ids)
    deltas, pos = [], 0
    for n in sizes:
        chunk = ids[pos:pos + n]
        pos += n
        deltas.append(detok.add(chunk, finished=finish and pos >= len(ids)))
    return deltas


def test_the_tokenizer_really_splits_characters(tok):
    # The tests below mean something only if some tokens are partial UTF-8 sequences.
    ids = tok.encode(MULTIBYTE)
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 4
    assert tok.decode(ids) == MULTIBYTE


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_multibyte_never_broken(tok, seed):
    ids = tok.encode(MULTIBYTE)
    sizes = None
    if seed is not None:
        rng = random.Random(seed)
        sizes = []
        while sum(sizes) < len(ids):
            sizes.append(rng.randint(1, 4))
    deltas = feed(IncrementalDetokenizer(tok), ids, sizes)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE
    # Text comes out as soon as it is complete, not all at the end.
    assert sum(1 for d in deltas if d) > len(deltas) // 3


def test_characters_wait_until_complete(tok):
    ids = tok.encode("日本語")
    detok = IncrementalDetokenizer(tok)
    seen = ""
    for i, t in enumerate(ids):
        seen += detok.add([t], finished=i == len(ids) - 1)
        assert seen == "日本語"[:len(seen)]  # only whole characters, each once
    assert seen == "日本語"


@pytest.mark.parametrize("text", [" hello world", "  two leading spaces", "\n\tindented"])
def test_leading_whitespace_kept(tok, text):
    ids = tok.encode(text)
    deltas = feed(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == text
    assert next(d for d in deltas if d)[0] == text[0]


def test_stop_string_held_back_then_dropped(tok):
    text = "The capital of France is Paris. The capital of Italy is Rome."
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=["Paris."])
    shown = ""
    for i, t in enumerate(ids):
        shown += detok.add([t], finished=i == len(ids) - 1)
        assert "P" not in shown  # not even the first letter while it may still become the stop string
        if detok.stopped:
            break
    assert detok.stopped
    assert shown == "The capital of France is "
    assert detok.add(tok.encode(" more"), finished=True) == ""  # nothing after the stop


def test_partial_stop_released_when_it_diverges(tok):
    text = "The capital of France is Paris. The end"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=["Paris!"])
    deltas = feed(detok, ids)
    assert not detok.stopped
    assert "".join(deltas) == text
    # "Paris" was held back until the "." showed it is not "Paris!".
    at = next(i for i, _ in enumerate(deltas) if "Paris" in "".join(deltas[:i + 1]))
    assert "." in "".join(deltas[:at + 1]).split("Paris", 1)[1]


def test_partial_stop_flushed_at_finish(tok):
    ids = tok.encode("The capital of France is Pa")
    deltas = feed(IncrementalDetokenizer(tok, stop=["Paris"]), ids)
    assert "".join(deltas) == "The capital of France is Pa"


def test_stop_string_spanning_two_tokens(tok):
    ids = tok.encode("Hello world")
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[1].endswith("o") and pieces[2].startswith(" w")  # "lo" | " w": the stop spans both
    detok = IncrementalDetokenizer(tok, stop=["o w"])
    assert "".join(feed(detok, ids)) == "Hell"
    assert detok.stopped


def test_multibyte_stop_string(tok):
    ids = tok.encode("emoji: 日本語 then more")
    detok = IncrementalDetokenizer(tok, stop=["本語"])
    deltas = feed(detok, ids)
    assert "".join(deltas) == "emoji: 日"
    assert not any("\ufffd" in d for d in deltas)


def _token_completing(tok, ids: list[int], stop: str, after: int = 0) -> int:
    """Index of the token whose text first completes an occurrence of stop ending beyond char `after`."""
    return next(j for j in range(len(ids)) if tok.decode(ids[:j + 1]).find(stop, max(0, after - len(stop) + 1)) != -1)


@pytest.mark.parametrize("sizes", [None, [3] * 40, [40]], ids=["one-by-one", "threes", "all-at-once"])
def test_min_new_tokens_skips_a_stop_string_completed_before_it(tok, sizes):
    text = "The cat sat. The dog ran. The cat ate."
    ids = tok.encode(text)
    first = _token_completing(tok, ids, "cat")
    # min_new_tokens just past the first "cat": that one is plain text, the second one stops.
    m = first + 2
    detok = IncrementalDetokenizer(tok, stop=["cat"], min_new_tokens=m)
    shown = "".join(feed(detok, ids, sizes))
    assert detok.stopped
    assert shown == "The cat sat. The dog ran. The "
    # With min_new_tokens at the token that completes the first "cat", that one counts.
    detok = IncrementalDetokenizer(tok, stop=["cat"], min_new_tokens=first + 1)
    assert "".join(feed(detok, ids, sizes)) == "The "


def test_min_new_tokens_counts_a_stop_string_spanning_the_boundary(tok):
    ids = tok.encode("Hello world, hello")
    k = _token_completing(tok, ids, "o w")  # "lo" | " w": starts in token k-1, ends in token k
    detok = IncrementalDetokenizer(tok, stop=["o w"], min_new_tokens=k + 1)
    assert "".join(feed(detok, ids)) == "Hell" and detok.stopped
    detok = IncrementalDetokenizer(tok, stop=["o w"], min_new_tokens=k + 2)
    assert "".join(feed(detok, ids)) == "Hello world, hello" and not detok.stopped


def test_special_tokens_skipped_or_kept(tok):
    eos = next(iter(tok.eos_token_ids))
    ids = [*tok.encode("Hello"), eos]
    assert "".join(feed(IncrementalDetokenizer(tok), ids)) == "Hello"
    assert "".join(feed(IncrementalDetokenizer(tok, skip_special_tokens=False), ids)) == "Hello<|im_end|>"


def _scheduler_stop(tok, ids: list[int], stop: list[str], m: int) -> int | None:
    """Where the scheduler's per-token check (Req.check_finished on stop_check_tail) ends generation."""
    from runtime.managers.req import Req
    from runtime.sampling.params import SamplingParams
    from runtime.text.detokenizer import stop_check_tail

    r = Req("r", [1], SamplingParams(stop=stop, min_new_tokens=m, max_new_tokens=1000, ignore_eos=True), 0,
            frozenset())
    for t in ids:
        r.output_ids.append(t)
        r.check_finished(10**6, stop_check_tail(tok.decode, r.output_ids, max(map(len, stop))))
        if r.finished:
            return len(r.output_ids)
    return None


@pytest.mark.parametrize(("text", "stop"), [
    ("The cat🙂 ran, the cat ran", ["cat"]), ("The cat é ran", ["cat"]), ("The catécat", ["cat"]),
    ("日本語 cat 日本語cat", ["本語"]), ("The cat🙂 ran", ["t🙂"]), ("Émile a mangé une crème", ["me", "è"]),
])
def test_scheduler_and_detokenizer_agree_on_stops_with_min_new_tokens(tok, text, stop):
    ids = tok.encode(text)
    for m in range(0, len(ids) + 1):
        n = _scheduler_stop(tok, ids, stop, m)
        detok = IncrementalDetokenizer(tok, stop=stop, min_new_tokens=m)
        shown = "".join(detok.add([t], finished=j == (n or len(ids)) - 1) for j, t in enumerate(ids[:n]))
        assert detok.stopped == (n is not None), (m, n, shown)
        if n is None:
            assert shown == text
