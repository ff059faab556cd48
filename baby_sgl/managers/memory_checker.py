"""Invariant 4: every KV slot has exactly one owner (free list, tree, a running request, or a
streaming session between turns). Each structure checks itself (allocator, request-slot pool,
prefix cache, sessions); this module adds what none of them can see alone: that their slots,
put together, are the pool, each slot once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from baby_sgl.errors import MemoryLeakError

if TYPE_CHECKING:
    from baby_sgl.core.req import Req
    from baby_sgl.managers.scheduler import Scheduler

__all__ = ["MemoryLeakError", "check_memory", "pool_counts"]


def _owned(reqs: list[Req], table: torch.Tensor, page: int) -> list[torch.Tensor]:
    """Slots past each request's tree-owned prefix, whole pages (the tail page is all theirs)."""
    owned = []
    for r in reqs:
        if r.req_pool_idx is not None and r.alloc_len > r.cache_protected_len:
            start = table[r.req_pool_idx, r.cache_protected_len : r.alloc_len].cpu()
            pages = start[::page] // page
            owned.append((pages[:, None] * page + torch.arange(page, device="cpu")).flatten())
    return owned


def _ownership(sched: Scheduler) -> tuple[dict[str, int], list[torch.Tensor], list[torch.Tensor]]:
    """The slot counts of each owner, and the slots requests and sessions own."""
    alloc, cache, table = sched.allocator, sched.tree_cache, sched.req_to_token_pool.req_to_token
    by_reqs = _owned(sched.active_reqs(), table, alloc.page_size)
    by_sessions = _owned(sched.sessions.held_reqs(), table, alloc.page_size)
    counts = {
        "total": alloc.size,
        "free": alloc.available_size(),
        "evictable": cache.evictable_size(),
        "protected": cache.protected_size(),
        "request_owned": sum(len(p) for p in by_reqs),
        "session_held": sum(len(p) for p in by_sessions),
    }
    return counts, by_reqs, by_sessions


def pool_counts(sched: Scheduler) -> dict[str, int]:
    """KV slots by owner (the identity check_memory asserts, without the per-slot checks)."""
    return _ownership(sched)[0]


def check_memory(sched: Scheduler) -> dict[str, int]:
    """Raises MemoryLeakError unless each structure is sound (and AssertionError unless each
    request holding KV is: Req.check) and free + evictable + protected +
    request-owned + session-held == total with no slot owned twice; when idle, the only request
    slots in use and the only locked tree nodes must be those of streaming sessions between
    turns. Returns the counts."""
    alloc, cache, pool, sessions = sched.allocator, sched.tree_cache, sched.req_to_token_pool, sched.sessions
    for structure in (alloc, pool, cache, sessions):
        structure.check()
    for req in sched.active_reqs() + sessions.held_reqs():
        req.check()
    counts, by_reqs, by_sessions = _ownership(sched)
    every = torch.cat([alloc.free_slots(), cache.all_slots().cpu()] + by_reqs + by_sessions)
    if len(every) != alloc.size or len(torch.unique(every)) != alloc.size:
        raise MemoryLeakError(f"KV slot ownership broken: {counts}, owned {len(every)}, distinct {len(torch.unique(every))}")
    if sum(v for k, v in counts.items() if k != "total") != alloc.size:
        raise MemoryLeakError(f"KV slot accounting broken: {counts}")
    if not sched.has_work():
        held = sessions.held_reqs()
        locked = cache.locked_tokens([r.last_node for r in held])
        if counts["protected"] != locked:
            raise MemoryLeakError(f"idle but tree nodes are locked beyond the sessions' {locked} tokens: {counts}")
        if pool.used() != len(held):
            raise MemoryLeakError(f"idle but {pool.used()} request slots are held, sessions hold {len(held)}")
    sched.runner.check_ranks()  # tensor parallelism: every rank's slot table and pool agree with these
    return counts
