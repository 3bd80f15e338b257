"""Sampling parameters (validated where a request enters) and the penalties applied to logits."""

from runtime.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
