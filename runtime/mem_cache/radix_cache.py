"""RadixCache: a radix tree from token-id prefixes to the KV slots that already hold their K/V.

Page size 1: every token owns exactly one slot. The tree owns the slots of every token stored in it;
they go back to the KVAllocator only through `evict` or `reset`.

Accounting: each non-root node's tokens count as *protected* while some request holds a lock on the
node or on one of its descendants, and as *evictable* otherwise. `total_size()` is their sum, so at any
moment `allocator.available_size() + cache.total_size() + slots held outside the tree == allocator.size`.

Namespaces: KV computed under a LoRA adapter differs from the base model's for the same tokens, so each
adapter's prefixes live in a tree of their own (namespace = the adapter's id; 0 = the base model, `root`).
A request's cache_salt splits them further (namespace = (adapter id, salt)): tenants of different salts
never share a prefix, as vLLM's salted block hashes and SGLang's extra_key keep them apart. Eviction and
accounting span every tree (one LRU over all of them). The base model's trees are reported to `events`
(cache-aware routing), a salted one under page hashes seeded with its salt, so a gateway matches a prompt
only against its own salt's prefixes; adapters' trees are not reported. A namespace's root goes once its
last node is evicted, and a lookup never makes one, so a salt per user leaves nothing behind.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from runtime.errors import DoubleFreeError
from runtime.mem_cache.allocator import KVAllocator
from runtime.mem_cache.cache_event_log import CacheEventLog

# A tree of the prefix cache: a LoRA adapter's id (0: the base model), or that id and a cache_salt.
Namespace = int | tuple[int, str]


class TreeNode:
    """One edge of the radix tree: `key` tokens whose K/V live in the slots `value` (same length).

    Keys are tuples: a tuple of ints drops out of Python's cyclic collector after its first collection,
    while a list is walked element by element by every full collection. A cache of 1,000 x 2,000 tokens
    (finished 1,000 x 1,000 requests): a full collection 53 -> 43 ms on this project's 2-core CPU VM (of which
    ~31 ms is torch and the rest of the process; 2M list elements alone cost ~16 ms a walk)."""

    __slots__ = ("id", "parent", "children", "key", "value", "lock_ref", "last_access")

    def __init__(self, node_id: int, parent: TreeNode | None, key: tuple[int, ...], value: torch.Tensor):
        # Ties in last_access (one tick stamps a whole path) break by creation order, so eviction
        # order is fully deterministic.
        self.id = node_id
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = 0

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass(frozen=True, slots=True)
class MatchResult:
    kv_indices: torch.Tensor  # int64 slots of the longest cached prefix of the query (may be empty)
    last_node: TreeNode  # where the match ended (a root when nothing matched); lock it while in use


def _reported(namespace: Namespace) -> bool:
    """The base model's trees, salted or not, are what cache-aware routing sees (module docstring)."""
    return namespace == 0 or (type(namespace) is tuple and namespace[0] == 0)


def _salt(namespace: Namespace) -> str | None:
    return namespace[1] if type(namespace) is tuple else None


def _common_prefix_len(a: list[int], a_start: int, b: tuple[int, ...]) -> int:
    n = min(len(a) - a_start, len(b))
    i = 0
    while i < n and a[a_start + i] == b[i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, allocator: KVAllocator, disable: bool = False, events: CacheEventLog | None = None):
        self.allocator = allocator
        self.disable = disable
        self.events = events  # told of every stored and evicted prefix (cache-aware routing reads it)
        # A logical clock instead of wall time: LRU order must not depend on timer resolution.
        self._clock = 0
        self._next_id = 0
        self.root = self._new_node(None, (), torch.empty(0, dtype=torch.int64))
        self._roots: dict[Namespace, TreeNode] = {0: self.root}  # namespace → its tree's root (made on first insert)
        self._namespace_of: dict[TreeNode, Namespace] = {self.root: 0}  # the reverse: whose tree a leaf left
        self._evictable_size = 0
        self._protected_size = 0
        # Unlocked childless nodes, i.e. exactly what `evict` may take next.
        self._evictable_leaves: set[TreeNode] = set()

    # ---------------------------------------------------------------- queries

    def match_prefix(self, token_ids: list[int], namespace: Namespace = 0) -> MatchResult:
        """Longest cached prefix of `token_ids`.

        If the match ends inside an edge, that edge is split so `last_node` covers exactly the matched
        tokens (locking it must not protect tokens the caller does not use). Every node on the matched
        path becomes most recently used.
        """
        node = self._roots.get(namespace)
        if self.disable or not token_ids or node is None:  # no tree made for a lookup: see _drop_namespace
            return MatchResult(torch.empty(0, dtype=torch.int64), self.root if node is None else node)
        tick = self._tick()
        values: list[torch.Tensor] = []
        pos = 0
        while pos < len(token_ids):
            child = node.children.get(token_ids[pos])
            if child is None:
                break
            n = _common_prefix_len(token_ids, pos, child.key)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            values.append(child.value)
            node = child
            pos += n
        kv = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return MatchResult(kv, node)

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    # ---------------------------------------------------------------- updates

    def insert(self, token_ids: list[int], kv_indices: torch.Tensor, namespace: Namespace = 0) -> int:
        """Store `token_ids` with their slots `kv_indices`; return `prefix_len`, how many leading tokens
        were already in the tree before this call.

        Ownership after the call, for a caller that earlier matched `cached_len` tokens of this
        sequence (and kept that node locked, so `cached_len <= prefix_len`):
          * `kv_indices[:cached_len]` are the tree's own slots (they came from `match_prefix`); don't free.
          * `kv_indices[cached_len:prefix_len]` duplicate tokens the tree already had under other slots;
            the tree keeps its own copy, so these are still the caller's and the CALLER MUST FREE them.
          * `kv_indices[prefix_len:]` now belong to the tree; the caller must not free them.
        In disable mode this returns 0 and the caller keeps every slot.
        """
        if len(token_ids) != kv_indices.numel():
            raise ValueError(f"insert: {len(token_ids)} tokens but {kv_indices.numel()} KV slots")
        if self.disable or not token_ids:
            return 0
        tick = self._tick()
        node = self._root(namespace)
        pos = 0
        while pos < len(token_ids):
            child = node.children.get(token_ids[pos])
            if child is None:
                # Clone: callers often pass a view into their req→token table, which they will reuse.
                value = kv_indices[pos:].to(torch.int64).clone()
                leaf = self._new_node(node, tuple(token_ids[pos:]), value)
                leaf.last_access = tick
                node.children[token_ids[pos]] = leaf
                self._evictable_size += len(leaf.key)
                self._refresh_leaf_status(leaf)
                self._refresh_leaf_status(node)
                if self.events is not None and _reported(namespace):
                    self.events.stored(token_ids, pos, _salt(namespace))
                break
            n = _common_prefix_len(token_ids, pos, child.key)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            node = child
            pos += n
        return pos

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect `node` and all its ancestors from eviction until the matching `dec_lock_ref`."""
        if self.disable:
            return
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            self._refresh_leaf_status(node)
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode) -> None:
        if self.disable:
            return
        while node.parent is not None:
            if node.lock_ref == 0:
                raise DoubleFreeError(f"dec_lock_ref on an unlocked node {node!r}: a lock was released twice")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
            self._refresh_leaf_status(node)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots if the unlocked part of the tree holds them; return how many
        were freed.

        Takes whole leaves, least recently used first; a parent becomes a candidate once its last child
        is gone. May free more than asked (a leaf is never cut), or less when too much is locked.
        """
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed, values = 0, []
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            values.append(leaf.value)  # freed together below: one free-list update, not one per leaf
            freed += len(leaf.key)
            self._evictable_size -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None
            if self.events is not None:
                top, path = self._path(leaf)
                namespace = self._namespace_of[top]
                if _reported(namespace):
                    self.events.removed(path, len(path) - len(leaf.key), _salt(namespace))
            del parent.children[leaf.key[0]]
            self._evictable_leaves.discard(leaf)
            leaf.parent = None
            if parent.parent is None and not parent.children and parent is not self.root:
                self._drop_namespace(parent)
            self._refresh_leaf_status(parent)
            if parent in self._evictable_leaves:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if values:
            self.allocator.free(torch.cat(values))
        return freed

    def reset(self) -> None:
        """Return every cached slot to the allocator and empty the tree. Nothing may be locked."""
        if self._protected_size:
            raise DoubleFreeError(
                f"reset with {self._protected_size} locked tokens: their slots are still in use by requests"
            )
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                self.allocator.free(node.value)
                stack.extend(node.children.values())
            root.children.clear()
        self._roots = {0: self.root}
        self._namespace_of = {self.root: 0}
        self._evictable_leaves.clear()
        self._evictable_size = 0
        self._protected_size = 0
        if self.events is not None:
            self.events.cleared()

    # ---------------------------------------------------------------- debug

    def pretty_print(self) -> str:
        lines = [
            f"RadixCache(evictable={self._evictable_size}, protected={self._protected_size}, "
            f"disable={self.disable})"
        ]
        stack: list[tuple[TreeNode, int]] = [(c, 1) for c in reversed(self._sorted_children(self.root))]
        while stack:
            node, depth = stack.pop()
            preview = list(node.key[:8])
            more = "..." if len(node.key) > 8 else ""
            lines.append(
                f"{'  ' * depth}#{node.id} len={len(node.key)} key={preview}{more} "
                f"lock={node.lock_ref} t={node.last_access}"
            )
            stack.extend((c, depth + 1) for c in reversed(self._sorted_children(node)))
        return "\n".join(lines)

    # ---------------------------------------------------------------- internals

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(self, parent: TreeNode | None, key: tuple[int, ...], value: torch.Tensor) -> TreeNode:
        node = TreeNode(self._next_id, parent, key, value)
        self._next_id += 1
        return node

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after `n` tokens; return the new upper node (which holds those n tokens).

        The upper node inherits the lock count: every lock on `child` also covered these tokens, so
        evictable/protected sizes and the leaf set are unchanged.
        """
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = self._new_node(parent, child.key[:n], child.value[:n])
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[child.key[0]] = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def _root(self, namespace: Namespace) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = self._new_node(None, (), torch.empty(0, dtype=torch.int64))
            self._namespace_of[root] = namespace
        return root

    def _drop_namespace(self, root: TreeNode) -> None:
        """A namespace's tree lost its last node: its root goes too, so the LoRA ids of unloaded adapters (fresh
        per load) and salts no longer sent leave nothing behind. A later insert makes a new root (_root)."""
        del self._roots[self._namespace_of.pop(root)]

    def _path(self, node: TreeNode) -> tuple[TreeNode, list[int]]:
        """(the root of node's tree, every token from it down to the end of node's edge)."""
        keys: list[tuple[int, ...]] = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent  # type: ignore[assignment]
        return node, [t for key in reversed(keys) for t in key]

    def _refresh_leaf_status(self, node: TreeNode) -> None:
        if node.parent is not None and not node.children and node.lock_ref == 0:
            self._evictable_leaves.add(node)
        else:
            self._evictable_leaves.discard(node)

    @staticmethod
    def _sorted_children(node: TreeNode) -> list[TreeNode]:
        return sorted(node.children.values(), key=lambda c: c.key[0])
