"""The scheduler's KV memory: request rows (ReqToTokenPool), KV slots (the allocator) and the prefix
cache, and invariant 4 over them: every KV slot has exactly one owner (free list, tree, a running
request, or a streaming session between turns). Each structure checks itself (allocator,
request-slot pool, prefix cache, sessions); `check` adds what none of them can see alone: that
their slots, put together, are the pool, each slot once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from baby_sgl.errors import MemoryLeakError

if TYPE_CHECKING:
    from baby_sgl.core.memory_pool import ReqToTokenPool
    from baby_sgl.core.req import Req
    from baby_sgl.managers.session_controller import SessionController
    from baby_sgl.mem_cache.allocator import PagedTokenAllocator
    from baby_sgl.mem_cache.base_prefix_cache import BasePrefixCache


@dataclass(frozen=True)
class KVMemory:
    req_to_token_pool: ReqToTokenPool
    allocator: PagedTokenAllocator
    tree_cache: BasePrefixCache[Any]

    def row_slots(self, req: Req, start: int, end: int) -> torch.Tensor:
        """The KV slots at positions start..end of req's row, on the CPU."""
        return self.req_to_token_pool.req_to_token[req.row(), start:end].cpu()

    def free_rows(self) -> int:
        return len(self.req_to_token_pool.free_slots)

    def flush(self) -> None:
        """Evicts every unlocked page of the prefix cache."""
        self.tree_cache.evict(self.allocator.size)

    def load(self) -> dict[str, int]:
        """KV slots in use (not free, not evictable), cached (evictable) and in all."""
        cached = self.tree_cache.evictable_size()
        return {"kv_used_tokens": self.allocator.size - self.allocator.available_size() - cached,
                "kv_cached_tokens": cached, "kv_total_tokens": self.allocator.size}

    def pool_counts(self, active: list[Req], held: list[Req]) -> dict[str, int]:
        """KV slots by owner (the identity `check` asserts, without the per-slot checks); active:
        the requests holding KV, held: the rows streaming sessions keep between turns."""
        return self._ownership(active, held)[0]

    def check(self, active: list[Req], sessions: SessionController, idle: bool) -> dict[str, int]:
        """Raises MemoryLeakError unless each structure is sound (and AssertionError unless each
        request holding KV is: Req.check) and free + evictable + protected + request-owned +
        session-held == total with no slot owned twice; when idle, the only request slots in use
        and the only locked tree nodes must be those of streaming sessions between turns. Returns
        the counts."""
        alloc, cache, pool = self.allocator, self.tree_cache, self.req_to_token_pool
        for structure in (alloc, pool, cache, sessions):
            structure.check()
        held = sessions.held_reqs()
        for req in active + held:
            req.check()
        counts, by_reqs, by_sessions = self._ownership(active, held)
        every = torch.cat([alloc.free_slots(), cache.all_slots().cpu()] + by_reqs + by_sessions)
        if len(every) != alloc.size or len(torch.unique(every)) != alloc.size:
            raise MemoryLeakError(f"KV slot ownership broken: {counts}, owned {len(every)}, "
                                  f"distinct {len(torch.unique(every))}")
        if sum(v for k, v in counts.items() if k != "total") != alloc.size:
            raise MemoryLeakError(f"KV slot accounting broken: {counts}")
        if idle:
            locked = cache.locked_tokens([r.kv.last_node for r in held])
            if counts["protected"] != locked:
                raise MemoryLeakError(f"idle but tree nodes are locked beyond the sessions' {locked} tokens: {counts}")
            if pool.used() != len(held):
                raise MemoryLeakError(f"idle but {pool.used()} request slots are held, sessions hold {len(held)}")
        return counts

    def _ownership(self, active: list[Req], held: list[Req]) -> tuple[dict[str, int], list[torch.Tensor],
                                                                       list[torch.Tensor]]:
        """The slot counts of each owner, and the slots requests and sessions own."""
        alloc, cache = self.allocator, self.tree_cache
        by_reqs, by_sessions = self._owned(active), self._owned(held)
        counts = {
            "total": alloc.size,
            "free": alloc.available_size(),
            "evictable": cache.evictable_size(),
            "protected": cache.protected_size(),
            "request_owned": sum(len(p) for p in by_reqs),
            "session_held": sum(len(p) for p in by_sessions),
        }
        return counts, by_reqs, by_sessions

    def _owned(self, reqs: list[Req]) -> list[torch.Tensor]:
        """Slots past each request's tree-owned prefix, whole pages (the tail page is all theirs)."""
        page = self.allocator.page_size
        owned = []
        for r in reqs:
            if r.kv.req_pool_idx is not None and r.kv.alloc_len > r.kv.cache_protected_len:
                pages = self.row_slots(r, r.kv.cache_protected_len, r.kv.alloc_len)[::page] // page
                owned.append((pages[:, None] * page + torch.arange(page, device="cpu")).flatten())
        return owned
