"""The LoRA messages that cross a boundary: an adapter loaded at run time as every TP rank reads it
(LoraLoad), a load's or unload's answer across an actor boundary (LoraUpdate), and the adapters a
scheduler's requests run (LoraRequests, in SchedulerStats). runtime.messages re-exports them."""

from __future__ import annotations

import msgspec


class LoraLoad(msgspec.Struct, frozen=True):
    """An adapter loaded at run time (POST /v1/load_lora_adapter, Engine.load_lora_adapter), as every TP rank
    reads it before any request may name it. lora_id is fresh for each load (never reused): it names the
    adapter on the workers and is its prefix-cache namespace, so a reload under the same name never meets
    the KV of the weights it replaced."""

    lora_id: int
    name: str
    path: str


class LoraUpdate(msgspec.Struct, kw_only=True):
    """The answer of a load or unload that crossed an actor boundary: error None on success; not_found: the
    name is not served (an unload's 404)."""

    error: str | None = None
    not_found: bool = False


class LoraRequests(msgspec.Struct, kw_only=True):
    """--enable-lora: the adapters a scheduler's requests run now (SchedulerStats.lora; vLLM's
    vllm:lora_requests_info). Names sorted, each once: an adapter is in `running` while some request of it
    holds KV, in `waiting` while some request of it is queued (both, when both hold). A request whose
    adapter was unloaded while it ran is in neither: its name is no longer served."""

    max_loras: int  # adapter slots (--max-loras): a batch mixes at most this many adapters
    running: list[str] = []
    waiting: list[str] = []

    @staticmethod
    def merged(parts: list[LoraRequests | None]) -> LoraRequests | None:
        """Replicas' adapters as one server's: the names of any replica, and their slots summed (the server
        runs that many adapters at once, as its running names may number). None: LoRA is off."""
        on = [p for p in parts if p is not None]
        if not on:
            return None
        return LoraRequests(max_loras=sum(p.max_loras for p in on),
                            running=sorted({n for p in on for n in p.running}),
                            waiting=sorted({n for p in on for n in p.waiting}))
