"""The cache used when the radix cache is disabled: nothing is shared, each request owns its row."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from baby_sgl.mem_cache.allocator import PagedTokenAllocator
from baby_sgl.mem_cache.memory_pool import ReqToTokenPool

if TYPE_CHECKING:
    from baby_sgl.managers.req import Req


class ChunkCache:
    root = None

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: PagedTokenAllocator, tracer=None) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = allocator.page_size

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, None]:
        return torch.empty(0, dtype=torch.int64), None

    def cache_unfinished_req(self, req: Req) -> None:
        """Between chunks the row simply stays with the request."""

    def release_req(self, req: Req) -> None:
        if req.req_pool_idx is None:
            return
        self.allocator.free(self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].cpu())
        self.req_to_token_pool.free(req.req_pool_idx)
        req.reset_kv_state()

    def inc_lock_ref(self, node: None) -> None:
        pass

    def dec_lock_ref(self, node: None) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def all_slots(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64)

    def reset(self) -> None:
        pass
