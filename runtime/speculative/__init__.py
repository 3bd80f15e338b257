"""Speculative decoding: drafters (who proposes the next K tokens) and the verify-step sampling rule.

The scheduler asks a Drafter for each running request's drafts (NGRAM answers from the request's own
tokens; STANDALONE leaves them to the worker's draft model), the worker scores last token + drafts in
one TARGET_VERIFY forward and keeps the drafts the target itself would have produced (VerifySampling)."""
