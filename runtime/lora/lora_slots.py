"""LoraSlots: the scheduler's map of the workers' --max-loras device slots to adapters. A request with an
adapter takes a slot when it is admitted (its adapter's, or a free one, loaded then) and holds it until it
finishes or is retracted; a request whose adapter finds no slot (all held by other adapters) waits. So a
batch never holds more adapters than slots, and a slot changes adapter only when no request uses it.

Ids: an adapter's id (1.., --lora-modules order) names it and its prefix-cache namespace; the slot it
occupies on the device (1..max_loras; 0 = the base model) is separate, and may change over its life."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.lora.lora_config import adapter_ids

if TYPE_CHECKING:
    from runtime.config import ServerArgs
    from runtime.managers.req import Req


class LoraSlots:
    def __init__(self, ids: dict[str, int], max_loras: int):
        self.ids = ids  # adapter name → id
        self.adapter = [0] * (max_loras + 1)  # slot → the adapter id loaded there (0: none)
        self.users = [0] * (max_loras + 1)  # slot → requests holding it
        self.last_use = [0] * (max_loras + 1)  # slot → tick of its last acquire (least recently used goes)
        self.tick = 0
        self.loads: list[list[int]] = []  # [slot, adapter id] the workers load before the next batch

    @classmethod
    def of(cls, args: ServerArgs) -> LoraSlots | None:
        return cls(adapter_ids(args.lora_modules), args.max_loras) if args.enable_lora else None

    def acquire(self, r: Req) -> bool:
        """Gives r its adapter's slot (loading the adapter into a free one if needed); False: none is free."""
        if r.lora_id == 0 or r.lora_slot:
            return True
        self.tick += 1
        if r.lora_id in self.adapter:
            slot = self.adapter.index(r.lora_id)
        else:
            free = [s for s in range(1, len(self.adapter)) if self.users[s] == 0]
            if not free:
                return False
            slot = min(free, key=lambda s: (self.adapter[s] != 0, self.last_use[s]))  # empty first, then LRU
            self.adapter[slot] = r.lora_id
            self.loads = [x for x in self.loads if x[0] != slot] + [[slot, r.lora_id]]
        self.users[slot] += 1
        self.last_use[slot] = self.tick
        r.lora_slot = slot
        return True

    def release(self, r: Req) -> None:
        if r.lora_slot:
            self.users[r.lora_slot] -= 1
            r.lora_slot = 0

    def take_loads(self) -> list[list[int]]:
        loads, self.loads = self.loads, []
        return loads
