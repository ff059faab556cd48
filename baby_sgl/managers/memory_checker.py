"""Invariant 4: every KV slot has exactly one owner (free list, tree, a running request, or a
streaming session between turns)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from baby_sgl.managers.scheduler import Scheduler


class MemoryLeakError(AssertionError):
    pass


def _owned(sched: Scheduler, reqs: list) -> list[torch.Tensor]:
    """Slots past each request's tree-owned prefix, whole pages (the tail page is all theirs)."""
    page, table = sched.allocator.page_size, sched.req_to_token_pool.req_to_token
    owned = []
    for r in reqs:
        if r.req_pool_idx is not None and r.alloc_len > r.cache_protected_len:
            start = table[r.req_pool_idx, r.cache_protected_len : r.alloc_len].cpu()
            pages = start[::page] // page
            owned.append((pages[:, None] * page + torch.arange(page, device="cpu")).flatten())
    return owned


def _session_locked(sched: Scheduler, held: list) -> int:
    """Tokens of the tree nodes that the sessions' held rows lock (each node counted once)."""
    nodes = {}
    for req in held:
        node = req.last_node
        while node is not None and node is not sched.tree_cache.root:
            nodes[id(node)] = len(node.key)
            node = node.parent
    return sum(nodes.values())


def _ownership(sched: Scheduler) -> tuple[dict[str, int], list[torch.Tensor], list[torch.Tensor]]:
    """The slot counts of each owner, and the slots requests and sessions own."""
    alloc, cache = sched.allocator, sched.tree_cache
    by_reqs = _owned(sched, sched.running + ([sched.chunked_req] if sched.chunked_req else []))
    by_sessions = _owned(sched, sched.sessions.held_reqs())
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
    """Raises MemoryLeakError unless free + evictable + protected + request-owned + session-held
    == total, with no slot owned twice; when idle, the only request slots in use and the only
    locked tree nodes must be those of streaming sessions between turns."""
    alloc, cache = sched.allocator, sched.tree_cache
    page = alloc.page_size
    free = torch.tensor(alloc.free_pages, dtype=torch.long, device="cpu")  # the check runs on the host
    free_slots = (free[:, None] * page + torch.arange(page, device="cpu")).flatten()
    held = sched.sessions.held_reqs()
    counts, by_reqs, by_sessions = _ownership(sched)
    every = torch.cat([free_slots, cache.all_slots().cpu()] + by_reqs + by_sessions)
    if len(every) != alloc.size or len(torch.unique(every)) != alloc.size:
        raise MemoryLeakError(f"KV slot ownership broken: {counts}, owned {len(every)}, distinct {len(torch.unique(every))}")
    if sum(v for k, v in counts.items() if k != "total") != alloc.size:
        raise MemoryLeakError(f"KV slot accounting broken: {counts}")
    if not sched.has_work():
        locked = _session_locked(sched, held)
        if counts["protected"] != locked:
            raise MemoryLeakError(f"idle but tree nodes are locked beyond the sessions' {locked} tokens: {counts}")
        used = sched.req_to_token_pool.size - len(sched.req_to_token_pool.free_slots)
        if used != len(held):
            raise MemoryLeakError(f"idle but {used} request slots are held, sessions hold {len(held)}")
    sched.runner.check_ranks()  # tensor parallelism: every rank's slot table and pool agree with these
    return counts
