"""LoraSlots: the scheduler's map of the workers' --max-loras device slots to adapters. A request with an
adapter takes a slot when it is admitted (its adapter's, or a free one, loaded then) and holds it until it
finishes or is retracted; a request whose adapter finds no slot (all held by other adapters) waits. So a
batch never holds more adapters than slots, and a slot changes adapter only when no request uses it.

Ids: an adapter's id (1.., --lora-modules order, then one fresh id per load at run time: LoraRegistry) names
it and its prefix-cache namespace; the slot it occupies on the device (1..max_loras; 0 = the base model) is
separate, and may change over its life. An unloaded adapter's id comes back through `drops` once its last
request finished: its slot is then empty (taken first), and the workers forget its weights."""

from __future__ import annotations

import queue
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.managers.req import Req


class LoraSlots:
    def __init__(self, ids: dict[str, int], max_loras: int):
        self.ids = ids  # adapter name → id (the LoraRegistry's, changed at run time)
        self.adapter = [0] * (max_loras + 1)  # slot → the adapter id loaded there (0: none)
        self.users = [0] * (max_loras + 1)  # slot → requests holding it
        self.last_use = [0] * (max_loras + 1)  # slot → tick of its last acquire (least recently used goes)
        self.tick = 0
        self.loads: list[list[int]] = []  # [slot, adapter id] the workers load before the next batch
        self.drops: queue.SimpleQueue[int] = queue.SimpleQueue()  # unloaded, unused ids (any thread puts)

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

    def could_acquire(self, r: Req, leaving: list[Req]) -> bool:
        """Whether acquire(r) would succeed once `leaving` (a preemption's victims) released their slots."""
        if r.lora_id == 0 or r.lora_slot or r.lora_id in self.adapter:
            return True
        gone = Counter(q.lora_slot for q in leaving if q.lora_slot)
        return any(self.users[s] - gone[s] == 0 for s in range(1, len(self.adapter)))

    def release(self, r: Req) -> None:
        if r.lora_slot:
            self.users[r.lora_slot] -= 1
            r.lora_slot = 0

    def take_loads(self) -> list[list[int]]:
        loads, self.loads = self.loads, []
        return loads

    def take_drops(self) -> list[int]:
        """Scheduler thread: the ids unloaded since the last call whose requests are all gone; their slots
        become empty. The workers forget them with the next batch (WorkerBatch.lora_drops)."""
        dropped = []
        while not self.drops.empty():
            lora_id = self.drops.get_nowait()
            dropped.append(lora_id)
            if lora_id in self.adapter:
                slot = self.adapter.index(lora_id)
                self.adapter[slot] = 0
                self.loads = [x for x in self.loads if x[0] != slot]
        return dropped
