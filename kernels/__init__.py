"""Lowest layer: Triton kernels called by attention backends and layers; each has a torch reference."""
