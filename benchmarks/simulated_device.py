"""SimulatedDeviceWorker: a WorkerClient that behaves like a CUDA TpWorker in time only — for finding
host-side costs of the engine paths (in-process Engine vs Ray scheduler actor) on a machine without a GPU.

launch_batch spends host time the way a real launch does (many short torch calls, each releasing and
re-taking the GIL) and queues the batch on a simulated device timeline; finish_batch sleeps (GIL
released, like cudaEventSynchronize) until the device would be done. The tokens are a fixed function
of the position, so the scheduler, the sinks, the actor's polls and the clients all run for real.

Install it before the engine is built: `install()` in this process (Engine), and in Ray workers through
`ray.init(runtime_env={"worker_process_setup_hook": "simulated_device.install", ...})` with this folder
on PYTHONPATH. SHOAL_SIM_DEVICE holds the timing (see SimTiming.from_env)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

import torch

from runtime.messages import BatchResult, WorkerBatch, WorkerInfo
from runtime.model_executor.forward_mode import ForwardMode

ENV = "SHOAL_SIM_DEVICE"


@dataclass(frozen=True, slots=True)
class SimTiming:
    prefill_ms_per_token: float = 0.022  # 8B bf16 on an H100: ~10 ms for 462 tokens
    prefill_base_ms: float = 0.5
    decode_ms: float = 6.7  # the 8B batch-1 step
    decode_ms_per_req: float = 0.02
    prefill_launch_calls: int = 700  # eager forward: ~20 launches per layer x 32 layers + sampling
    decode_launch_calls: int = 60  # graph replay: metadata copies, plan, replay, sampler, copies

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> SimTiming:
        raw = os.environ.get(ENV)
        return cls(**json.loads(raw)) if raw else cls()


class SimulatedDeviceWorker:
    can_overlap = True
    can_defer_sampling = False

    def __init__(self, args, model_path, ctx=None, device=None):
        self.args = args
        self.timing = SimTiming.from_env()
        self._free_at = 0.0  # when the simulated device finishes what is queued
        self._scratch = torch.zeros(8)
        self._busy_s = 0.0

    def bind_thread(self) -> None:
        pass

    def info(self) -> WorkerInfo:
        return WorkerInfo(max_total_tokens=self.args.max_total_tokens or 65536, max_reqs=self.args.max_running_requests + 4,
                          context_len=self.args.context_length or 4096, vocab_size=32000, eos_token_ids=[2],
                          attention_backend="simulated", device="cuda:0")

    def release(self) -> None:
        pass

    def run_batch(self, batch: WorkerBatch) -> BatchResult:
        return self.finish_batch(self.launch_batch(batch))

    def launch_batch(self, batch: WorkerBatch, sample_later: bool = False) -> tuple:
        t = self.timing
        mode = ForwardMode(batch.forward_mode)
        n_reqs = len(batch.seq_lens)
        if mode.is_decode():
            calls, device_ms = t.decode_launch_calls, t.decode_ms + t.decode_ms_per_req * n_reqs
        else:
            calls = t.prefill_launch_calls
            device_ms = t.prefill_base_ms + t.prefill_ms_per_token * len(batch.input_ids)
        x = self._scratch
        for _ in range(calls):  # each torch call drops and re-takes the GIL, as a CUDA launch does
            x = x.add_(1.0)
        now = time.perf_counter()
        start = max(now, self._free_at)
        self._free_at = start + device_ms / 1e3
        tokens = [100 + (s % 1000) for s in batch.seq_lens]
        return (batch.batch_id, self._free_at, tokens, device_ms / 1e3, now)

    def finish_batch(self, launched: tuple) -> BatchResult:
        batch_id, ready, tokens, device_s, t0 = launched
        wait = ready - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return BatchResult(batch_id=batch_id, next_token_ids=tokens, device_s=device_s,
                           forward_s=time.perf_counter() - t0)


def install() -> None:
    """Makes the in-process Engine and Ray's TP ranks build a SimulatedDeviceWorker instead of a TpWorker."""
    import runtime.cluster.tp_rank as tp_rank
    import runtime.engine as engine

    engine.TpWorker = SimulatedDeviceWorker
    tp_rank.TpWorker = SimulatedDeviceWorker
