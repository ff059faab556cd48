"""Invariant 4: every KV slot has exactly one owner (free list, tree, a running request)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from baby_sgl.managers.scheduler import Scheduler


class MemoryLeakError(AssertionError):
    pass


def _request_owned(sched: Scheduler) -> list[torch.Tensor]:
    """Slots past each request's tree-owned prefix, whole pages (the tail page is all theirs)."""
    page, table = sched.allocator.page_size, sched.req_to_token_pool.req_to_token
    reqs = sched.running + ([sched.chunked_req] if sched.chunked_req else [])
    owned = []
    for r in reqs:
        if r.req_pool_idx is not None and r.kv_len > r.cache_protected_len:
            start = table[r.req_pool_idx, r.cache_protected_len : r.kv_len].cpu()
            pages = start[::page] // page
            owned.append((pages[:, None] * page + torch.arange(page)).flatten())
    return owned


def check_memory(sched: Scheduler) -> dict[str, int]:
    """Raises MemoryLeakError unless free + evictable + protected + request-owned == total, with
    no slot owned twice; when idle, also every request slot must be free and nothing locked."""
    alloc, cache = sched.allocator, sched.tree_cache
    page = alloc.page_size
    free = torch.tensor(alloc.free_pages, dtype=torch.long)
    free_slots = (free[:, None] * page + torch.arange(page)).flatten()
    parts = [free_slots, cache.all_slots()] + _request_owned(sched)
    every = torch.cat(parts)
    counts = {
        "total": alloc.size,
        "free": alloc.available_size(),
        "evictable": cache.evictable_size(),
        "protected": cache.protected_size(),
        "request_owned": sum(len(p) for p in parts[2:]),
    }
    if len(every) != alloc.size or len(torch.unique(every)) != alloc.size:
        raise MemoryLeakError(f"KV slot ownership broken: {counts}, owned {len(every)}, distinct {len(torch.unique(every))}")
    if counts["free"] + counts["evictable"] + counts["protected"] + counts["request_owned"] != alloc.size:
        raise MemoryLeakError(f"KV slot accounting broken: {counts}")
    if not sched.has_work():
        if counts["protected"] != 0:
            raise MemoryLeakError(f"idle but tree nodes are still locked: {counts}")
        used = sched.req_to_token_pool.size - len(sched.req_to_token_pool.free_slots)
        if used:
            raise MemoryLeakError(f"idle but {used} request slots are still held")
    return counts
