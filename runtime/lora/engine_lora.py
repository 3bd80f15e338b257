"""EngineLora: the in-process Engine's adapters at run time (kept here: engine.py is at its size limit) —
SGLang's Engine.load_lora_adapter / unload_lora_adapter for Python callers, and the EngineClient side the
gateway's /v1/load_lora_adapter and /load_lora_adapter routes call. The scheduler's LoraRegistry decides;
the in-process TpWorker reads the adapter (on the caller's thread, off the scheduler's) before any request
may name it."""

from __future__ import annotations

import asyncio
from typing import Any


class EngineLora:
    host: Any  # SchedulerHost (Engine sets both)
    worker: Any  # TpWorker

    def load_lora_adapter(self, lora_name: str, lora_path: str, load_inplace: bool = False) -> None:
        """Serves the PEFT adapter folder lora_path as `lora_name` (generate(..., lora_name=...), and `model`
        on every HTTP route) from now on. InvalidRequestError naming the problem: LoRA off (--enable-lora),
        a name already served (load_inplace=True replaces it: running requests keep the old weights), a rank
        above --max-lora-rank, untargetable modules, shapes the model does not have, a missing folder."""
        self.host.scheduler.lora_ids.load(lora_name, lora_path, self.worker.add_lora, replace=load_inplace)

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stops serving `lora_name` at once (LoraNotFoundError if it is not served): new requests naming it
        are refused; those already running or waiting finish with it; its slot and weights go after them."""
        self.host.scheduler.lora_ids.unload(lora_name)

    def lora_adapters(self) -> dict[str, str]:
        return self.host.scheduler.lora_ids.served()

    async def add_lora(self, name: str, path: str, replace: bool = False) -> None:
        await asyncio.to_thread(self.load_lora_adapter, name, path, replace)  # reads files: off the loop

    async def remove_lora(self, name: str) -> None:
        await asyncio.to_thread(self.unload_lora_adapter, name)  # waits for a load in progress: off the loop
