"""LoraDelta under tensor parallelism, at layer level on CPU: two ranks of the fused qkv, gate_up and the
row-parallel o/down projections, each with two adapters in its slots, give together (output shards
concatenated; row-parallel partial sums added, as the all-reduce does) what one rank computes with each
token's adapter merged into the weights; slot-0 tokens get the base output exactly."""

from __future__ import annotations

import pytest
import torch

from runtime.distributed.parallel_group import ParallelGroup
from runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from runtime.lora.lora_batch import LoraBatch
from runtime.lora.lora_layer import LoraDelta

H, HD, HEADS, T = 16, 4, 4, 6
SLOTS = torch.tensor([0, 1, 2, 1, 0, 2])


def _adapters(subs: dict[object, tuple[int, int]], r: int, seed: int) -> dict[object, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {s: (torch.randn(r, fan_in, generator=g), torch.randn(fan_out, r, generator=g))
            for s, (fan_in, fan_out) in subs.items()}


def _run(make, full_weights: dict[object, torch.Tensor], adapters: list[dict], row: bool, tp: int) -> list[torch.Tensor]:
    """Each rank's output for x with the two adapters in slots 1 and 2."""
    torch.manual_seed(0)
    x = torch.randn(T, next(iter(full_weights.values())).shape[1])
    outs = []
    for rank in range(tp):
        layer = make(ParallelGroup(rank=rank, size=tp))
        for shard, w in full_weights.items():
            layer.weight_loader(layer.weight, w, shard)
        batch = LoraBatch(2, torch.float32, torch.device("cpu"))
        layer.lora = LoraDelta(layer, batch, len(full_weights), 2, 8, row_parallel=row)
        for slot, adapter in enumerate(adapters, 1):
            for sub, shard in enumerate(full_weights):
                if shard in adapter:
                    layer.lora.load(slot, sub, shard, *adapter[shard])
        batch.prepare(SLOTS)
        local = x.shape[1] // tp
        outs.append(layer(x[:, rank * local:(rank + 1) * local] if row else x))
    return x, outs


def _merged(x: torch.Tensor, w: torch.Tensor, ab: list[tuple[torch.Tensor, torch.Tensor] | None]) -> torch.Tensor:
    """Row t: x_t (W + B_s A_s)^T for its slot s (0: W)."""
    rows = []
    for t in range(T):
        s = int(SLOTS[t])
        wt = w if s == 0 or ab[s - 1] is None else w + ab[s - 1][1] @ ab[s - 1][0]
        rows.append(x[t] @ wt.t())
    return torch.stack(rows)


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_and_gate_up_column_shards(tp: int):
    q, kv = HEADS * HD, 2 * HD
    g = torch.Generator().manual_seed(1)
    ws = {"q": torch.randn(q, H, generator=g), "k": torch.randn(kv, H, generator=g), "v": torch.randn(kv, H, generator=g)}
    a1 = _adapters({"q": (H, q), "v": (H, kv)}, 4, 2)
    a2 = _adapters({"k": (H, kv), "q": (H, q)}, 8, 3)
    x, outs = _run(lambda grp: QKVParallelLinear(H, HD, HEADS, 2, False, grp, dtype=torch.float32),
                   ws, [a1, a2], row=False, tp=tp)
    for name, size in (("q", q), ("k", kv), ("v", kv)):
        full = _merged(x, ws[name], [a1.get(name), a2.get(name)])
        local = size // tp
        start = {"q": 0, "k": q // tp, "v": q // tp + kv // tp}[name]
        got = torch.cat([o[:, start:start + local] for o in outs], dim=1)
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-4)

    wgu = {0: torch.randn(10, H, generator=g), 1: torch.randn(10, H, generator=g)}
    b1, b2 = _adapters({1: (H, 10)}, 4, 4), _adapters({0: (H, 10), 1: (H, 10)}, 2, 5)
    x, outs = _run(lambda grp: MergedColumnParallelLinear(H, [10, 10], False, grp, torch.float32),
                   wgu, [b1, b2], row=False, tp=tp)
    for sub in (0, 1):
        full = _merged(x, wgu[sub], [b1.get(sub), b2.get(sub)])
        local = 10 // tp
        got = torch.cat([o[:, sub * local:(sub + 1) * local] for o in outs], dim=1)
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tp", [1, 2])
def test_row_parallel_partial_sums(tp: int):
    g = torch.Generator().manual_seed(6)
    w = {None: torch.randn(12, H, generator=g)}
    c1, c2 = _adapters({None: (H, 12)}, 4, 7), _adapters({None: (H, 12)}, 8, 8)
    x, outs = _run(lambda grp: RowParallelLinear(H, 12, False, grp, reduce_results=False, dtype=torch.float32),
                   w, [c1, c2], row=True, tp=tp)
    full = _merged(x, w[None], [c1[None], c2[None]])
    torch.testing.assert_close(sum(outs), full, rtol=1e-5, atol=1e-4)
    base = torch.nn.functional.linear(x[:, : H // tp], w[None][:, : H // tp])
    assert torch.equal(outs[0][SLOTS == 0], base[SLOTS == 0])  # slot 0: the base output, bit for bit
