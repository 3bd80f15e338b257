"""Pdl: programmatic dependent launch (PDL) for our Triton kernels on sm90+.

A kernel launched with PDL may start while the kernel before it in the stream is still running. Why: a
batch-1 decode step is ~300 short kernels, and each dependent launch drains the GPU (the next kernel's
first loads wait for the last block of the previous one); with PDL the next kernel's blocks are resident
and, for the GEMV, already streaming their first weight tile when the previous kernel finishes.

The contract every kernel taking USE_PDL keeps (kernels/*.py):
- gdc_wait() before it reads anything a previous kernel wrote and before it writes anything (a previous
  kernel may still be reading the memory); only constant data (weights) may be read before it;
- gdc_launch_dependents() right after that wait, so the kernel after it can be scheduled as soon as this
  one's last wave is resident (it cannot get past its own wait before this kernel has finished).
A kernel launched without PDL (torch, cuBLAS, flashinfer, NCCL) still waits for everything before it, and
its dependents wait for it, so mixing PDL and plain launches is safe. CUDA graphs keep PDL edges.

SHOAL_PDL=0 turns it off; off on CPU, under the Triton interpreter and before Hopper."""

from __future__ import annotations

import os

import torch


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels working on `t` launch with PDL."""
    return (t.is_cuda and os.environ.get("SHOAL_PDL", "1") != "0"
            and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and torch.cuda.get_device_capability(t.device)[0] >= 9)


def launch_options(pdl: bool) -> dict[str, bool]:
    """The Triton launch keyword for PDL (absent when off, so the interpreter never sees it)."""
    return {"launch_pdl": True} if pdl else {}
