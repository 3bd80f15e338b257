"""Process groups for tensor parallelism (and the MLP group of DP attention). Used by layers; knows
nothing about scheduling."""

from runtime.distributed.parallel_group import ParallelGroup

__all__ = ["ParallelGroup"]
