from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from runtime.errors import DoubleFreeError
from runtime.mem_cache.allocator import KVAllocator
from runtime.mem_cache.radix_cache import RadixCache, TreeNode


class RecordingAllocator(KVAllocator):
    """Remembers which slots were freed, so a test can tell exactly what eviction gave back."""

    def __init__(self, size: int):
        super().__init__(size)
        self.freed: list[int] = []

    def free(self, indices: torch.Tensor) -> None:
        super().free(indices)
        self.freed.extend(indices.flatten().tolist())


@dataclass
class Harness:
    """The cache plus the slots the test itself holds (as a running request would)."""

    alloc: RecordingAllocator
    cache: RadixCache
    held: int = 0

    @classmethod
    def make(cls, size: int = 64, disable: bool = False) -> Harness:
        alloc = RecordingAllocator(size)
        return cls(alloc, RadixCache(alloc, disable=disable))

    def take(self, n: int) -> torch.Tensor:
        out = self.alloc.alloc(n)
        assert out is not None
        self.held += n
        return out

    def give_back(self, slots: torch.Tensor) -> None:
        self.alloc.free(slots)
        self.held -= slots.numel()

    def cache_seq(self, tokens: list[int]) -> tuple[int, torch.Tensor]:
        """Run one request through the cache the way the scheduler does; return (prefix_len, its slots)."""
        m = self.cache.match_prefix(tokens)
        self.cache.inc_lock_ref(m.last_node)
        cached = m.kv_indices.numel()
        kv = torch.cat([m.kv_indices, self.take(len(tokens) - cached)])
        self.check()
        prefix_len = self.cache.insert(tokens, kv)
        self.give_back(kv[cached:prefix_len])
        self.held -= len(tokens) - prefix_len  # ownership moved to the tree
        self.cache.dec_lock_ref(m.last_node)
        self.check()
        return prefix_len, kv

    def check(self) -> None:
        c = self.cache
        assert self.alloc.available_size() + c.total_size() + self.held == self.alloc.size
        evictable, protected = _walk_sizes(c.root)
        assert (c.evictable_size(), c.protected_size()) == (evictable, protected)
        assert c.total_size() == evictable + protected


def _walk_sizes(root: TreeNode) -> tuple[int, int]:
    """Recompute sizes from the tree itself and check its structure on the way."""
    evictable = protected = 0
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        assert node.parent is not None and node.parent.children[node.key[0]] is node
        assert len(node.key) == node.value.numel() > 0 and node.value.dtype == torch.int64
        assert node.parent is root or node.parent.lock_ref >= node.lock_ref
        if node.lock_ref:
            protected += len(node.key)
        else:
            evictable += len(node.key)
        stack.extend(node.children.values())
    return evictable, protected


def test_match_on_empty_tree() -> None:
    h = Harness.make()
    for query in ([], [1, 2, 3]):
        m = h.cache.match_prefix(query)
        assert m.kv_indices.dtype == torch.int64 and m.kv_indices.numel() == 0
        assert m.last_node is h.cache.root
    assert h.cache.total_size() == 0
    h.check()


def test_insert_then_full_and_partial_match() -> None:
    h = Harness.make()
    prefix_len, kv = h.cache_seq([1, 2, 3, 4, 5])
    assert prefix_len == 0
    full = h.cache.match_prefix([1, 2, 3, 4, 5])
    assert torch.equal(full.kv_indices, kv)
    longer = h.cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert torch.equal(longer.kv_indices, kv) and longer.last_node is full.last_node
    partial = h.cache.match_prefix([1, 2, 3, 9])
    assert torch.equal(partial.kv_indices, kv[:3])
    assert h.cache.match_prefix([2, 3]).kv_indices.numel() == 0
    assert h.cache.total_size() == h.cache.evictable_size() == 5
    h.check()


def test_split_mid_edge_preserves_values_and_sizes() -> None:
    h = Harness.make()
    _, kv = h.cache_seq([1, 2, 3, 4, 5, 6])
    leaf = h.cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    h.cache.inc_lock_ref(leaf)
    before = (h.cache.evictable_size(), h.cache.protected_size())
    assert before == (0, 6)

    m = h.cache.match_prefix([1, 2, 3, 9])
    upper = m.last_node
    assert upper.key == (1, 2, 3) and torch.equal(upper.value, kv[:3])
    assert leaf.key == (4, 5, 6) and torch.equal(leaf.value, kv[3:])
    assert leaf.parent is upper and upper.parent is h.cache.root
    assert upper.lock_ref == 1  # the lock on the leaf already covered these tokens
    assert (h.cache.evictable_size(), h.cache.protected_size()) == before
    assert torch.equal(h.cache.match_prefix([1, 2, 3, 4, 5, 6]).kv_indices, kv)
    h.check()

    h.cache.dec_lock_ref(leaf)
    assert (h.cache.evictable_size(), h.cache.protected_size()) == (6, 0)
    h.check()


def test_insert_returns_already_present_length() -> None:
    h = Harness.make()
    assert h.cache_seq([1, 2, 3, 4])[0] == 0
    assert h.cache_seq([1, 2, 3, 4, 5, 6])[0] == 4
    assert h.cache_seq([1, 2, 7])[0] == 2
    assert h.cache_seq([1, 2, 3])[0] == 3
    assert h.cache_seq([1, 2, 3, 4, 5, 6])[0] == 6
    assert h.cache.total_size() == 7  # 1 2 3 4 5 6 and the 7 branch

    # A caller that did not match first (cached_len 0) owns duplicates of everything already present.
    dup = h.take(5)
    prefix_len = h.cache.insert([1, 2, 3, 4, 9], dup)
    assert prefix_len == 4
    h.give_back(dup[:prefix_len])
    h.held -= 1
    h.check()
    m = h.cache.match_prefix([1, 2, 3, 4, 9])
    assert m.kv_indices[-1].item() == dup[4].item()
    assert not torch.equal(m.kv_indices[:4], dup[:4])  # the tree kept its own slots


def test_insert_rejects_mismatched_lengths_and_copies_its_input() -> None:
    h = Harness.make()
    with pytest.raises(ValueError):
        h.cache.insert([1, 2, 3], torch.tensor([1, 2], dtype=torch.int64))
    slots = h.take(3)
    original = slots.clone()
    assert h.cache.insert([1, 2, 3], slots) == 0
    h.held -= 3
    slots.fill_(0)  # the caller reusing its buffer must not corrupt the tree
    assert torch.equal(h.cache.match_prefix([1, 2, 3]).kv_indices, original)
    h.check()


def test_branching_keys() -> None:
    h = Harness.make()
    _, a = h.cache_seq([1, 2, 3])
    _, b = h.cache_seq([1, 2, 4])
    _, c = h.cache_seq([5, 6])
    assert sorted(h.cache.root.children) == [1, 5]
    assert h.cache.root.children[1].key == (1, 2)
    assert torch.equal(b[:2], a[:2])  # the second request reused the shared prefix
    for tokens, kv in (([1, 2, 3], a), ([1, 2, 4], b), ([5, 6], c)):
        assert torch.equal(h.cache.match_prefix(tokens).kv_indices, kv)
    assert h.cache.total_size() == 6
    text = h.cache.pretty_print()
    assert "key=[1, 2]" in text and "key=[3]" in text and "key=[5, 6]" in text
    h.check()


def test_lock_protects_from_eviction_and_unlock_releases() -> None:
    h = Harness.make()
    h.cache_seq([1, 2, 3, 4])
    h.cache_seq([1, 2, 5])
    nodes = [h.cache.match_prefix(t).last_node for t in ([1, 2, 3, 4], [1, 2, 5])]
    for n in nodes:
        h.cache.inc_lock_ref(n)
    assert (h.cache.evictable_size(), h.cache.protected_size()) == (0, 5)
    assert h.cache.evict(100) == 0
    assert h.cache.total_size() == 5
    h.check()

    h.cache.dec_lock_ref(nodes[0])
    assert (h.cache.evictable_size(), h.cache.protected_size()) == (2, 3)
    assert h.cache.evict(100) == 2  # only [3, 4]; [1, 2] is still under the other lock
    h.check()
    h.cache.dec_lock_ref(nodes[1])
    assert h.cache.evict(100) == 3
    assert h.cache.total_size() == 0 and h.alloc.available_size() == h.alloc.size
    h.check()


def test_lru_evicts_least_recently_matched_leaf_first() -> None:
    h = Harness.make()
    _, a = h.cache_seq([1, 1])
    _, b = h.cache_seq([2, 2])
    _, c = h.cache_seq([3, 3])
    h.cache.match_prefix([1, 1])
    h.cache.match_prefix([3, 3])
    h.alloc.freed.clear()
    assert h.cache.evict(1) == 2  # whole leaves only
    assert sorted(h.alloc.freed) == sorted(b.tolist())
    assert h.cache.evict(2) == 2
    assert sorted(h.alloc.freed[2:]) == sorted(a.tolist())
    assert torch.equal(h.cache.match_prefix([3, 3]).kv_indices, c)
    h.check()


def test_inner_node_is_evicted_only_after_its_children() -> None:
    h = Harness.make()
    _, a = h.cache_seq([1, 2, 3, 4])
    _, b = h.cache_seq([1, 2, 5, 6])
    h.cache.match_prefix([1, 2])  # the inner node is now the most recent, its leaves are older
    h.alloc.freed.clear()
    assert h.cache.evict(2) == 2
    assert h.cache.match_prefix([1, 2]).kv_indices.numel() == 2
    assert h.cache.evict(3) == 4  # the other leaf, then the inner node once it became a leaf
    assert sorted(h.alloc.freed[-2:]) == sorted(a[:2].tolist())
    assert h.cache.total_size() == 0 and not h.cache.root.children
    h.check()


def test_unlock_twice_and_reset_while_locked_raise() -> None:
    h = Harness.make()
    h.cache_seq([1, 2, 3])
    node = h.cache.match_prefix([1, 2, 3]).last_node
    h.cache.inc_lock_ref(node)
    with pytest.raises(DoubleFreeError):
        h.cache.reset()
    h.cache.dec_lock_ref(node)
    with pytest.raises(DoubleFreeError):
        h.cache.dec_lock_ref(node)


def test_reset_frees_everything() -> None:
    h = Harness.make()
    for t in ([1, 2, 3], [1, 2, 4], [7, 8, 9, 10]):
        h.cache_seq(t)
    h.cache.reset()
    h.check()
    assert h.cache.total_size() == 0 and h.alloc.available_size() == h.alloc.size
    assert h.cache.match_prefix([1, 2, 3]).kv_indices.numel() == 0
    h.cache_seq([1, 2, 3])  # usable again afterwards
    assert h.cache.total_size() == 3


def test_disable_mode_is_a_no_op() -> None:
    h = Harness.make(disable=True)
    slots = h.take(3)
    assert h.cache.insert([1, 2, 3], slots) == 0  # the caller keeps ownership
    m = h.cache.match_prefix([1, 2, 3])
    assert m.kv_indices.numel() == 0 and m.last_node is h.cache.root
    h.cache.inc_lock_ref(m.last_node)
    h.cache.dec_lock_ref(m.last_node)
    assert h.cache.evict(10) == 0
    assert (h.cache.evictable_size(), h.cache.protected_size(), h.cache.total_size()) == (0, 0, 0)
    h.check()
    h.give_back(slots)
    h.check()


# ---------------------------------------------------------------- randomized property test


@dataclass
class Running:
    tokens: list[int]
    node: TreeNode
    cached: int
    kv: torch.Tensor


@dataclass
class Model:
    """Reference: every cached prefix (as a tuple) → the slot holding its last token."""

    slot_of: dict[tuple[int, ...], int] = field(default_factory=dict)

    def longest(self, tokens: list[int]) -> int:
        n = 0
        while n < len(tokens) and tuple(tokens[: n + 1]) in self.slot_of:
            n += 1
        return n

    def slots(self, tokens: list[int], n: int) -> list[int]:
        return [self.slot_of[tuple(tokens[: i + 1])] for i in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ops_keep_accounting_and_values(seed: int) -> None:
    rng = random.Random(seed)
    h = Harness.make(size=48)
    model = Model()
    running: list[Running] = []
    pinned: list[tuple[TreeNode, list[int]]] = []

    def rand_tokens() -> list[int]:
        return [rng.randrange(3) for _ in range(rng.randint(1, 10))]

    def locked_prefixes() -> set[tuple[int, ...]]:
        paths = [(r.tokens, r.cached) for r in running] + [(t, len(t)) for _, t in pinned]
        return {tuple(t[: i + 1]) for t, n in paths for i in range(n)}

    def match(tokens: list[int]) -> tuple[TreeNode, torch.Tensor]:
        m = h.cache.match_prefix(tokens)
        assert m.kv_indices.tolist() == model.slots(tokens, model.longest(tokens))
        return m.last_node, m.kv_indices

    def evict(n: int) -> None:
        h.alloc.freed.clear()
        locked = locked_prefixes()
        freed = h.cache.evict(n)
        assert freed == len(h.alloc.freed)
        gone = set(h.alloc.freed)
        for p in [p for p, s in model.slot_of.items() if s in gone]:
            assert p not in locked
            del model.slot_of[p]
        assert all(len(p) == 1 or p[:-1] in model.slot_of for p in model.slot_of)
        if freed < n:
            assert h.cache.evictable_size() == 0

    def finish(r: Running) -> None:
        prefix_len = h.cache.insert(r.tokens, r.kv)
        assert prefix_len == model.longest(r.tokens) >= r.cached
        for i in range(prefix_len, len(r.tokens)):
            model.slot_of[tuple(r.tokens[: i + 1])] = int(r.kv[i])
        h.give_back(r.kv[r.cached : prefix_len])
        h.held -= len(r.tokens) - prefix_len
        h.cache.dec_lock_ref(r.node)

    for _ in range(300):
        op = rng.choices(["start", "finish", "match", "pin", "unpin", "evict"], [4, 3, 3, 1, 1, 1])[0]
        if op == "start":
            tokens = rand_tokens()
            node, prefix_kv = match(tokens)
            h.cache.inc_lock_ref(node)
            cached = prefix_kv.numel()
            need = len(tokens) - cached
            if h.alloc.available_size() < need:
                evict(need - h.alloc.available_size())
            if h.alloc.available_size() < need:
                h.cache.dec_lock_ref(node)
            else:
                new = h.take(need)
                running.append(Running(tokens, node, cached, torch.cat([prefix_kv, new])))
        elif op == "finish" and running:
            finish(running.pop(rng.randrange(len(running))))
        elif op == "match":
            match(rand_tokens())
        elif op == "pin":
            tokens = rand_tokens()
            node, kv = match(tokens)
            h.cache.inc_lock_ref(node)
            pinned.append((node, tokens[: kv.numel()]))
        elif op == "unpin" and pinned:
            h.cache.dec_lock_ref(pinned.pop(rng.randrange(len(pinned)))[0])
        elif op == "evict":
            evict(rng.randint(1, 12))
        h.check()
        assert h.cache.total_size() == len(model.slot_of)
        assert h.cache.protected_size() == len(locked_prefixes())

    # Every sequence still cached matches to the slots it was inserted with.
    for p, slot in model.slot_of.items():
        assert h.cache.match_prefix(list(p)).kv_indices[-1].item() == slot
    while running:
        finish(running.pop())
        h.check()
    for node, _ in pinned:
        h.cache.dec_lock_ref(node)
    assert h.cache.protected_size() == 0
    h.cache.reset()
    h.check()
    assert h.held == 0 and h.alloc.available_size() == h.alloc.size


def test_keys_are_tuples_the_cyclic_collector_leaves_alone() -> None:
    """Stored keys (and the halves of a split) are tuples of ints, which Python's collector untracks: a
    cache of long prompts adds nothing to a full collection's walk (lists are walked element by element)."""
    import gc

    alloc = KVAllocator(64)
    cache = RadixCache(alloc)
    kv = alloc.alloc(12)
    cache.insert(list(range(1, 13)), kv)
    cache.insert([1, 2, 3, 99], torch.cat([kv[:3], alloc.alloc(1)]))  # splits the first edge after 3 tokens
    gc.collect()
    nodes = [cache.root.children[1], *cache.root.children[1].children.values()]
    assert [n.key for n in nodes] == [(1, 2, 3), (4, 5, 6, 7, 8, 9, 10, 11, 12), (99,)]
    assert not any(gc.is_tracked(n.key) for n in nodes)
