"""DeviceMemory: where an in-process Engine's GPU memory went, read after a timed run.

Why: `--mem-fraction-static` sizes the KV pool as a share of the whole device, leaving the rest for
activations, CUDA graphs, workspaces and the CUDA context. 0.85 of an H200 leaves ~21 GiB, of an H100
~12 GiB, whatever the model needs. How much of that the process touched, start-up included (the torch
allocator's peak plus what lives outside it), says how much pool was left on the table."""

from __future__ import annotations

from typing import Any

from runtime.model_executor.memory_report import GIB, tensor_bytes


def summarize(total: int, free: int, reserved: int, peak_reserved: int, peak_allocated: int,
              pool: int, weights: int) -> dict[str, float]:
    """Byte counts → GiB. used_now = total - free counts the CUDA context, cuBLAS and NCCL workspaces
    (outside torch's allocator); peak_used adds the allocator's peak over what it holds now; headroom is
    what even that peak never touched; other_peak = peak_used - pool - weights (activations, graphs,
    workspaces, context): the memory a pool size must leave."""
    used_now = total - free
    peak_used = used_now + max(0, peak_reserved - reserved)
    out = {"total": total, "used_now": used_now, "outside_torch": used_now - reserved,
           "torch_reserved_now": reserved, "torch_peak_reserved": peak_reserved,
           "torch_peak_allocated": peak_allocated, "kv_pool": pool, "weights": weights,
           "peak_used": peak_used, "other_peak": peak_used - pool - weights, "headroom": total - peak_used}
    return {f"{k}_gib": round(v / GIB, 3) for k, v in out.items()}


def device_memory(engine: Any) -> dict[str, float] | None:
    """The summary for `engine`'s in-process worker on CUDA; None on CPU or without one."""
    runner = getattr(getattr(engine, "worker", None), "runner", None)
    device = getattr(runner, "device", None)
    if runner is None or device is None or device.type != "cuda":
        return None
    import torch

    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    pool = runner.token_to_kv_pool
    return summarize(total, free, torch.cuda.memory_reserved(device), torch.cuda.max_memory_reserved(device),
                     torch.cuda.max_memory_allocated(device), tensor_bytes([*pool.k_buffers, *pool.v_buffers]),
                     tensor_bytes(runner.model.parameters()) + tensor_bytes(runner.model.buffers()))
