"""NgramDrafter: the longest matching suffix wins, the most recent occurrence is used, matches stay
token-aligned, and it never proposes more than asked."""

from __future__ import annotations

import pytest

from runtime.config import ServerArgs
from runtime.speculative.drafter import create_drafter
from runtime.speculative.ngram_drafter import NgramDrafter
from runtime.speculative.standalone_drafter import StandaloneDrafter


def drafter(lo: int = 1, hi: int = 4) -> NgramDrafter:
    return NgramDrafter(ServerArgs(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=lo,
                                   speculative_ngram_max_match_window_size=hi))


def test_copies_what_followed_the_earlier_occurrence():
    d = drafter()
    assert d.propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 3) == [8, 9, 1]
    assert d.propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 10) == [8, 9, 1, 5, 6, 7]  # runs up to the end
    assert d.propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 0) == []


def test_longest_window_first_then_most_recent():
    d = drafter()
    # The 3-token suffix [2, 3, 4] matches at the start (followed by 10) before any shorter suffix is tried.
    toks = [2, 3, 4, 10, 3, 4, 11, 2, 3, 4]
    assert d.propose(toks, 2) == [10, 3]
    # Only the 1-gram matches: the most recent earlier occurrence of 4 is followed by 11.
    assert d.propose([3, 4, 10, 3, 4, 11, 9, 4], 1) == [11]


def test_no_match_and_short_inputs():
    d = drafter(lo=2)
    assert d.propose([1, 2, 3, 4], 4) == []
    assert d.propose([7], 4) == []
    assert d.propose([], 4) == []


def test_byte_search_stays_token_aligned():
    # 256 = bytes 00 01 00 00 and 1 = 01 00 00 00: a misaligned byte match must not count.
    d = drafter(lo=1, hi=1)
    assert d.propose([256, 0, 7, 1], 2) == []
    assert d.propose([1, 9, 256, 0, 7, 1], 2) == [9, 256]


def test_registry():
    assert create_drafter(ServerArgs()) is None
    assert isinstance(create_drafter(ServerArgs(speculative_algorithm="NGRAM")), NgramDrafter)
    sa = create_drafter(ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="/x"))
    assert isinstance(sa, StandaloneDrafter) and sa.on_worker and sa.propose([1, 2], 3) == [0, 0, 0]


@pytest.mark.parametrize("kwargs, flag", [
    ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm"),
    ({"speculative_algorithm": "STANDALONE"}, "--speculative-draft-model-path"),
    ({"speculative_draft_model_path": "/x"}, "--speculative-draft-model-path"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 0}, "--speculative-num-draft-tokens"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 5},
     "--speculative-ngram-min-match-window-size"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/x", "dp_size": 2,
      "enable_dp_attention": True}, "--speculative-algorithm"),
])
def test_bad_flags_name_the_flag(kwargs, flag):
    from runtime.errors import ServerArgsError

    with pytest.raises(ServerArgsError) as e:
        ServerArgs(**kwargs)
    assert flag in str(e.value)
