"""RadixCache on its own: matching, splitting, page alignment, locks, LRU eviction, accounting,
and a property test against a plain-dictionary model of the cache."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from baby_sgl.mem_cache.allocator import PagedTokenAllocator
from baby_sgl.mem_cache.memory_pool import ReqToTokenPool
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
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "match", "evict"]), keys), max_size=30),
       page_size=st.sampled_from([1, 2, 4]))
def test_matches_reference_model(ops, page_size):
    """The tree answers like a set of cached page-aligned sequences, and never loses a slot."""
    cache = make_cache(page_size=page_size, slots=512)
    model: dict[tuple, list[int]] = {}  # every cached page-aligned prefix -> slots of its last page
    for op, key in ops:
        key = key[: len(key) // page_size * page_size]
        if op == "insert" and key:
            slots = put(cache, key)
            for i in range(page_size, len(key) + 1, page_size):
                model.setdefault(tuple(key[:i]), slots[i - page_size : i].tolist())
        elif op == "match":
            got, _ = cache.match_prefix(key)
            n = 0
            while n + page_size <= len(key) and tuple(key[: n + page_size]) in model:
                n += page_size
            assert got.tolist() == [s for i in range(page_size, n + 1, page_size) for s in model[tuple(key[:i])]]
        elif op == "evict":
            cache.evict(len(key) + 1)
            alive = {tuple(seq) for seq in _cached_sequences(cache)}
            model = {k: v for k, v in model.items() if k in alive}
        assert accounted(cache) == 512
        assert cache.evictable_size() == sum(len(n.key) for n in cache._nodes())


def _cached_sequences(cache: RadixCache) -> list[list[int]]:
    out, stack = [], [(cache.root, [])]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            seq = prefix + child.key
            out.extend(seq[:i] for i in range(1, len(seq) + 1))  # page-aligned ones are all we look up
            stack.append((child, seq))
    return out
