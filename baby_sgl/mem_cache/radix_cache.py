"""RadixAttention's prefix cache: a radix tree over token ids whose values are KV slot indices.

The tree only owns whole pages (invariant 3): keys are cut to multiples of page_size and a
child is found by its first page. Nodes with lock_ref > 0 are in use by running requests
(protected); unlocked leaves are evicted in LRU order.

As SGLang's extra key, a key may come with a namespace (the request's LoRA adapter): K/V computed
with one adapter is never found by a request with another. Each node keeps its namespace and a
child is found by (namespace, first page), so namespaces split at the root and never mix below.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from baby_sgl.errors import MemoryLeakError
from baby_sgl.mem_cache.allocator import PagedTokenAllocator
from baby_sgl.mem_cache.base_prefix_cache import BasePrefixCache, PrefixMatch
from baby_sgl.core.memory_pool import ReqToTokenPool

if TYPE_CHECKING:
    from baby_sgl.core.req import Req
    from baby_sgl.trace import Tracer

_counter = itertools.count()


class TreeNode:
    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None,
                 extra_key: str | None = None) -> None:
        self.key = key
        self.extra_key = extra_key
        self.value = value
        self.parent = parent
        self.children: dict[tuple[str | None, tuple[int, ...]], TreeNode] = {}
        self.lock_ref = 0
        self.last_access_time = time.monotonic()
        self.id = next(_counter)

    def up(self) -> TreeNode:
        """The parent of a node below the root."""
        assert self.parent is not None, "the root has no parent"
        return self.parent

    def __lt__(self, other: TreeNode) -> bool:  # heap order for LRU eviction
        return (self.last_access_time, self.id) < (other.last_access_time, other.id)


def _match_len(a: list[int], b: list[int], page: int) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n // page * page


class RadixCache(BasePrefixCache[TreeNode]):
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: PagedTokenAllocator,
                 tracer: Tracer | None = None, on_evict: Callable[[list[TreeNode]], None] | None = None) -> None:
        super().__init__(req_to_token_pool, allocator)
        self.tracer, self.on_evict = tracer, on_evict
        self.reset()

    def reset(self) -> None:
        self.version += 1
        self.root = TreeNode([], self.no_slots(), None)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size_ = 0
        self.protected_size_ = 0

    # ---- lookup and insertion -------------------------------------------------------------
    def _child_key(self, key: list[int], extra_key: str | None) -> tuple[str | None, tuple[int, ...]]:
        return extra_key, tuple(key[: self.page_size])

    def match_prefix(self, key: list[int], extra_key: str | None = None) -> PrefixMatch[TreeNode]:
        """The longest cached page-aligned prefix of key (in extra_key's namespace); its handle
        is the node where it ends."""
        key = key[: len(key) // self.page_size * self.page_size]
        node, values, now = self.root, [], time.monotonic()
        while key and (child := node.children.get(self._child_key(key, extra_key))) is not None:
            n = _match_len(child.key, key, self.page_size)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            values.append(child.value)
            node, key = child, key[n:]
        return PrefixMatch(torch.cat(values) if values else self.no_slots(), node)

    def insert(self, key: list[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        """Adds key -> value (page-aligned, in extra_key's namespace). Returns how much of key was
        already cached: the caller owns value[:that] as duplicates and must free what it does not keep."""
        assert len(key) % self.page_size == 0 and len(key) == len(value)
        node, done, now = self.root, 0, time.monotonic()
        while done < len(key) and (child := node.children.get(self._child_key(key[done:], extra_key))) is not None:
            n = _match_len(child.key, key[done:], self.page_size)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            node, done = child, done + n
        if done < len(key):
            leaf = TreeNode(key[done:], value[done:].clone().cpu(), node, extra_key)
            node.children[self._child_key(leaf.key, extra_key)] = leaf
            self.evictable_size_ += len(leaf.key)
            self.version += 1
            if self.tracer:
                self.tracer.event("cache_insert", tokens=len(leaf.key), cached=done)
        return done

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cuts child after n tokens; returns the new upper node, which keeps child's locks."""
        parent = child.up()
        upper = TreeNode(child.key[:n], child.value[:n], parent, child.extra_key)
        upper.lock_ref, upper.last_access_time = child.lock_ref, child.last_access_time
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._child_key(child.key, child.extra_key)] = child
        parent.children[self._child_key(upper.key, upper.extra_key)] = upper
        return upper

    # ---- locks and eviction ---------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
            node.lock_ref += 1
            node = node.up()

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "lock released twice"
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
            node.lock_ref -= 1
            node = node.up()

    def evict(self, num_tokens: int) -> int:
        """Frees at least num_tokens slots from unlocked leaves, least recently used first."""
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed, evicted = 0, []
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            evicted.append(leaf)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self.evictable_size_ -= len(leaf.key)
            parent = leaf.up()
            del parent.children[self._child_key(leaf.key, leaf.extra_key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        if freed:
            self.version += 1
        if freed and self.tracer:
            self.tracer.event("cache_evict", tokens=freed)
        if evicted and self.on_evict:
            self.on_evict(evicted)
        return freed

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def _nodes(self) -> list[TreeNode]:
        out: list[TreeNode] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            out.extend(node.children.values())
            stack.extend(node.children.values())
        return out

    def all_slots(self) -> torch.Tensor:
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else self.no_slots()

    def check(self) -> None:
        """Its own integrity: each node's slots match its key and appear in no other node; a
        lock on a node is a lock on its parent too; the two sizes count every node once."""
        nodes = self._nodes()
        if any(len(n.key) != len(n.value) or len(n.key) % self.page_size for n in nodes):
            raise MemoryLeakError("a radix node's slots do not match its key (or are not whole pages)")
        if any(n.up() is not self.root and n.lock_ref > n.up().lock_ref for n in nodes):
            raise MemoryLeakError("a radix node is locked more than its parent")
        locked = sum(len(n.key) for n in nodes if n.lock_ref > 0)
        if (self.protected_size_, self.evictable_size_) != (locked, sum(len(n.key) for n in nodes) - locked):
            raise MemoryLeakError(f"radix sizes {self.protected_size_} protected / {self.evictable_size_} evictable, "
                                  f"the nodes hold {locked} locked of {sum(len(n.key) for n in nodes)}")
        slots = self.all_slots()
        if len(torch.unique(slots)) != len(slots):
            raise MemoryLeakError("a KV slot is in two radix nodes")

    def locked_tokens(self, handles: list[TreeNode]) -> int:
        nodes: dict[int, int] = {}
        for handle in handles:
            node: TreeNode | None = handle
            while node is not None and node is not self.root:
                nodes[id(node)] = len(node.key)
                node = node.parent
        return sum(nodes.values())

    # ---- request lifecycle ----------------------------------------------------------------
    def _row(self, req: Req) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.row(), : req.kv.kv_len].cpu()

    def cache_unfinished_req(self, req: Req) -> None:
        """Gives the request's whole computed pages to the tree and repoints its row at the
        tree's slots, so later requests can share them while this one keeps running."""
        aligned = req.kv.kv_len // self.page_size * self.page_size
        if aligned <= req.kv.cache_protected_len:
            return
        tokens, slots = req.fill_ids[:aligned], self._row(req)[:aligned]
        known = self.insert(tokens, slots, req.lora_id)
        self.allocator.free(slots[req.kv.cache_protected_len : known])
        new_slots, node = self.match_prefix(tokens, req.lora_id)
        assert len(new_slots) == aligned
        self.req_to_token_pool.write(req.row(), 0, new_slots.to(self.req_to_token_pool.req_to_token.device))
        self.inc_lock_ref(node)
        self.dec_lock_ref(req.kv.last_node)
        req.kv.last_node, req.kv.cache_protected_len = node, aligned

    def _keep_pages(self, req: Req, row: torch.Tensor) -> int:
        """Whole computed pages go to the tree; slots the tree already had are duplicates."""
        aligned = req.kv.kv_len // self.page_size * self.page_size
        known = self.insert(req.fill_ids[:aligned], row[:aligned], req.lora_id) if aligned else 0
        self.allocator.free(row[req.kv.cache_protected_len : known])
        return aligned
