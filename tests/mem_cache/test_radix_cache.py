"""RadixCache on its own: matching, splitting, page alignment, locks, LRU eviction, accounting,
and a property test against a plain-dictionary model of the cache."""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from baby_sgl.errors import MemoryLeakError
from baby_sgl.mem_cache.allocator import PagedTokenAllocator
from baby_sgl.core.memory_pool import ReqToTokenPool
from baby_sgl.mem_cache import radix_cache
from baby_sgl.mem_cache.radix_cache import RadixCache


def make_cache(page_size: int = 1, slots: int = 256) -> RadixCache:
    alloc = PagedTokenAllocator(slots, page_size, torch.device("cpu"))
    return RadixCache(ReqToTokenPool(4, 64, torch.device("cpu")), alloc)


def put(cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Allocates slots for key and inserts them, freeing what the tree already had."""
    slots = cache.allocator.alloc_extend([0], [len(key)], [-1])
    known = cache.insert(key, slots)
    cache.allocator.free(slots[:known])
    return slots


def accounted(cache: RadixCache) -> int:
    return cache.allocator.available_size() + cache.evictable_size() + cache.protected_size()


def test_insert_and_match():
    cache = make_cache()
    slots = put(cache, [1, 2, 3, 4])
    got, node = cache.match_prefix([1, 2, 3, 4, 5])
    assert got.tolist() == slots.tolist()
    assert cache.match_prefix([9])[0].numel() == 0
    assert cache.evictable_size() == 4 and accounted(cache) == 256


def test_partial_match_splits_node():
    cache = make_cache()
    slots = put(cache, [1, 2, 3, 4])
    got, node = cache.match_prefix([1, 2, 7])
    assert got.tolist() == slots[:2].tolist()
    assert node.key == [1, 2] and list(node.children.values())[0].key == [3, 4]
    # A second branch shares the split node.
    other = put(cache, [1, 2, 8, 9])
    assert cache.match_prefix([1, 2, 8, 9])[0].tolist() == slots[:2].tolist() + other[2:].tolist()
    assert cache.evictable_size() == 6 and accounted(cache) == 256


def test_page_alignment():
    cache = make_cache(page_size=4)
    put(cache, list(range(8)))
    got, _ = cache.match_prefix(list(range(6)))  # 6 tokens match, only one whole page counts
    assert len(got) == 4
    got, _ = cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 98])
    assert len(got) == 4
    assert all(len(n.key) % 4 == 0 for n in cache._nodes())


def test_lock_protects_from_eviction():
    cache = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [5, 6])
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3])[0].numel() == 3
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 3 and accounted(cache) == 256


def test_lru_order():
    cache = make_cache()
    put(cache, [1, 1])
    put(cache, [2, 2])
    put(cache, [3, 3])
    cache.match_prefix([1, 1])  # touch: now [2, 2] is the least recently used
    cache.evict(2)
    assert cache.match_prefix([2, 2])[0].numel() == 0
    assert cache.match_prefix([1, 1])[0].numel() == 2 and cache.match_prefix([3, 3])[0].numel() == 2


def test_evict_walks_up_to_emptied_parents():
    cache = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    assert cache.evict(256) == 4
    assert not cache.root.children and accounted(cache) == 256


keys = st.lists(st.integers(0, 3), min_size=0, max_size=12)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "match", "evict", "lock", "unlock"]), keys), max_size=30),
       page_size=st.sampled_from([1, 2, 4]))
def test_matches_reference_model(ops, page_size):
    """The tree answers like a set of cached page-aligned sequences and never loses a slot; an
    eviction frees what it says, never a locked sequence, and least recently used leaves first."""
    clock = itertools.count()
    with mock.patch.object(radix_cache.time, "monotonic", lambda: next(clock)):  # a logical clock: no ties
        cache = make_cache(page_size=page_size, slots=512)
        model: dict[tuple, list[int]] = {}  # every cached page-aligned prefix -> slots of its last page
        used: dict[tuple, int] = {}  # prefix -> the last op whose lookup or insert went through it
        locks: list[tuple] = []  # (node, the sequence it holds), as a running request holds its prefix
        for now, (op, key) in enumerate(ops):
            key = key[: len(key) // page_size * page_size]
            prefixes = [tuple(key[:i]) for i in range(page_size, len(key) + 1, page_size)]
            if op == "insert" and key:
                slots = put(cache, key)
                for i, prefix in zip(range(page_size, len(key) + 1, page_size), prefixes):
                    model.setdefault(prefix, slots[i - page_size : i].tolist())
                    used[prefix] = now
            elif op in ("match", "lock"):
                got, node = cache.match_prefix(list(key))
                hit = list(itertools.takewhile(model.__contains__, prefixes))
                assert got.tolist() == [s for p in hit for s in model[p]]
                used.update({p: now for p in hit})
                if op == "lock" and hit:
                    cache.inc_lock_ref(node)
                    locks.append((node, hit[-1]))
            elif op == "unlock" and locks:
                cache.dec_lock_ref(locks.pop(0)[0])
            elif op == "evict":
                locked = {held[: i] for _, held in locks for i in range(page_size, len(held) + 1, page_size)}
                leaves = {p for p in model if not any(q[: len(p)] == p and len(q) > len(p) for q in model)}
                freed = cache.evict(len(key) + 1)
                alive = {tuple(seq) for seq in _cached_sequences(cache)}
                evicted = set(model) - alive
                assert freed == len(evicted) * page_size
                assert not evicted & locked, "a locked sequence was evicted"
                kept_leaves = [used[p] for p in leaves - locked - evicted]
                if evicted and kept_leaves:  # each victim was the least recently used leaf of its turn
                    assert max(used[p] for p in evicted) <= min(kept_leaves)
                if freed < len(key) + 1:  # short: nothing else could go
                    assert not leaves - locked - evicted
                model = {k: v for k, v in model.items() if k in alive}
            assert accounted(cache) == 512
            assert cache.evictable_size() + cache.protected_size() == sum(len(n.key) for n in cache._nodes())
        for node, _ in locks:
            cache.dec_lock_ref(node)
        assert cache.protected_size() == 0 and accounted(cache) == 512


def _cached_sequences(cache: RadixCache) -> list[list[int]]:
    out, stack = [], [(cache.root, [])]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            seq = prefix + child.key
            out.extend(seq[:i] for i in range(1, len(seq) + 1))  # page-aligned ones are all we look up
            stack.append((child, seq))
    return out


def test_each_structure_checks_itself():
    """The allocator, the request-slot pool and the tree each find their own corruption."""
    cache = make_cache(page_size=2, slots=16)
    alloc, pool = cache.allocator, cache.req_to_token_pool
    put(cache, [1, 2, 3, 4])
    cache.inc_lock_ref(cache.match_prefix([1, 2])[1])
    for structure in (alloc, pool, cache):
        structure.check()
    alloc.free_pages.append(alloc.free_pages[0])
    with pytest.raises(MemoryLeakError, match="free list twice"):
        alloc.check()
    alloc.free_pages[-1] = 99
    with pytest.raises(MemoryLeakError, match="outside the pool"):
        alloc.check()
    pool.free_slots.append(pool.free_slots[0])
    with pytest.raises(MemoryLeakError, match="free request slots"):
        pool.check()
    cache.protected_size_ += 2
    with pytest.raises(MemoryLeakError, match="radix sizes"):
        cache.check()
    cache.protected_size_ -= 2
    leaf = cache.match_prefix([1, 2, 3, 4])[1]
    leaf.lock_ref = leaf.parent.lock_ref + 1
    with pytest.raises(MemoryLeakError, match="locked more than its parent"):
        cache.check()
