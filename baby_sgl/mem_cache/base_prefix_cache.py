"""What the scheduler needs of a prefix cache, whichever one is configured.

RadixCache shares whole pages between requests; ChunkCache (the radix cache disabled) shares
nothing. Both take a finished request's KV through `release_req`, the one way a request's KV
leaves it (finish, abort, a failed batch, retraction, a session giving up its row).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

import torch

from baby_sgl.mem_cache.allocator import PagedTokenAllocator
from baby_sgl.core.memory_pool import ReqToTokenPool
from baby_sgl.core.req import KVPosition

if TYPE_CHECKING:
    from baby_sgl.core.req import Req


# A cache's handle on a matched prefix, which locks it: a radix tree node, or None without a tree.
# A request keeps it (Req.kv.last_node) without reading it; only the cache that made it does.
H = TypeVar("H")


class PrefixMatch(NamedTuple, Generic[H]):
    """What match_prefix found: the KV slots of the longest cached page-aligned prefix, and the
    handle that locks it (inc_lock_ref/dec_lock_ref)."""

    slots: torch.Tensor
    node: H


class BasePrefixCache(ABC, Generic[H]):
    root: H  # the handle a request locks when it matched nothing

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: PagedTokenAllocator) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = allocator.page_size
        # Changes whenever what match_prefix could find changes (an insertion, an eviction): a
        # match made at the same version is still valid, and its handle still in the cache.
        self.version = 0

    def no_slots(self) -> torch.Tensor:
        """An empty list of KV slots, on the pool's device."""
        return torch.empty(0, dtype=torch.int64, device=self.allocator.device)

    # ---- lookup and locks ----------------------------------------------------------------
    @abstractmethod
    def match_prefix(self, key: list[int], extra_key: str | None = None) -> PrefixMatch[H]:
        """The longest cached page-aligned prefix of key, among the keys cached with the same
        extra_key (a request's LoRA adapter)."""

    @abstractmethod
    def inc_lock_ref(self, node: H) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, node: H) -> None: ...

    # ---- accounting (the memory checker's identity) ----------------------------------------
    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Frees at least num_tokens unlocked slots if it can; returns how many it freed."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def all_slots(self) -> torch.Tensor:
        """Every KV slot the cache owns, locked or not."""

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def check(self) -> None:
        """Its own integrity; raises MemoryLeakError (the memory checker calls it)."""

    def locked_tokens(self, handles: list[H]) -> int:
        """Tokens that locks taken by these handles (match_prefix's) hold, each counted once:
        none without a tree."""
        return 0

    # ---- request lifecycle ----------------------------------------------------------------
    @abstractmethod
    def cache_unfinished_req(self, req: Req) -> None:
        """A running request's computed whole pages become shareable (or simply stay its own)."""

    @abstractmethod
    def _keep_pages(self, req: Req, row: torch.Tensor) -> int:
        """Offers a finishing request's computed whole pages to the cache; returns how many
        leading entries of row the request no longer owns (kept by the cache, or freed here
        as duplicates of what it already had). Always page-aligned."""

    def release_req(self, req: Req) -> None:
        """Takes back everything the request holds: its row's slots (computed or merely
        allocated for a pass that never ran), its lock on the tree and its request slot.
        Idempotent: a request with no row holds nothing."""
        if req.kv.req_pool_idx is None:
            return
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : req.kv.alloc_len].cpu()
        kept = self._keep_pages(req, row)
        self.allocator.free(row[kept:])
        self.dec_lock_ref(req.kv.last_node)
        self.req_to_token_pool.free(req.kv.req_pool_idx)
        req.kv = KVPosition()
