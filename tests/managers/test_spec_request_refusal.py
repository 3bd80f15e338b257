"""With --speculative-algorithm on, a grammar-constrained request is refused up front."""

from __future__ import annotations

import pytest

from runtime.errors import InvalidRequestError
from runtime.managers.request_validation import RequestLimits, validate_request
from runtime.messages import GenerateRequest
from runtime.sampling.params import SamplingParams


def test_grammar_requests_are_refused_with_speculation():
    """Structured output (a grammar mask per sampled token) and speculative decoding together: a 400 naming
    the grammar field, not a silently unconstrained output."""
    class Constrained(SamplingParams):  # stands for SamplingParams(regex=...) of the structured-output branch
        @property
        def grammar(self) -> tuple[str, str]:
            return ("regex", "[a-z]+")

    req = GenerateRequest(rid="g", input_ids=[1, 2], sampling_params=Constrained(max_new_tokens=4))
    assert validate_request(RequestLimits(64, 100, 64), req) is req
    with pytest.raises(InvalidRequestError) as e:
        validate_request(RequestLimits(64, 100, 64, speculative=True), req)
    assert e.value.param == "regex" and "speculative" in e.value.message
