"""Priorities with LoRA slots: a waiting request whose adapter would still find no slot after a preemption
does not preempt anyone (it had retracted and re-prefilled the same request every step: 58 retractions for
one 60-token request, review of a62d405); every request still finishes with its tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

from lora_files import write_adapter

from runtime import Engine

G = {"temperature": 0, "ignore_eos": True}
P = list(range(5, 45))


def test_no_preemption_when_the_adapter_slot_stays_taken(tiny_llama: Path, tmp_path: Path) -> None:
    x = write_adapter(tmp_path / "lx", tiny_llama, 1, ("q_proj", "v_proj"))
    y = write_adapter(tmp_path / "ly", tiny_llama, 2, ("q_proj", "v_proj"))
    engine = Engine(str(tiny_llama), device="cpu", dtype="float32", max_total_tokens=2048, log_level="warning",
                    enable_lora=True, lora_modules=f"X={x} Y={y}", max_loras=1, max_running_requests=2,
                    scheduling_policy="priority")

    async def main() -> list[dict]:
        r1 = asyncio.ensure_future(engine.async_generate(input_ids=P, sampling_params={**G, "max_new_tokens": 60},
                                                         lora_name="X", priority=0))
        r2 = asyncio.ensure_future(engine.async_generate(input_ids=P[::-1], sampling_params={
            **G, "max_new_tokens": 60}, lora_name="X", priority=5))
        while engine.get_stats().num_running_reqs < 2:
            assert not (r1.done() or r2.done()), "a request finished before both were seen running"
            await asyncio.sleep(0.001)
        h = asyncio.ensure_future(engine.async_generate(input_ids=P[:10], sampling_params={**G, "max_new_tokens": 4},
                                                        lora_name="Y", priority=0))
        return await asyncio.gather(r1, r2, h)

    try:
        outs = asyncio.run(main())
        assert [len(o["output_ids"]) for o in outs] == [60, 60, 4]
        assert engine.scheduler.priority.preempted == 0  # R1 holds X's only slot: retracting R2 frees nothing
    finally:
        engine.shutdown()
