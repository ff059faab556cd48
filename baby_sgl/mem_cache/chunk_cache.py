"""The cache used when the radix cache is disabled: nothing is shared, each request owns its row."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from baby_sgl.mem_cache.base_prefix_cache import BasePrefixCache, PrefixMatch

if TYPE_CHECKING:
    from baby_sgl.core.req import Req


class ChunkCache(BasePrefixCache[None]):
    root = None

    def match_prefix(self, key: list[int], extra_key: str | None = None) -> PrefixMatch[None]:
        return PrefixMatch(self.no_slots(), None)

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
        return self.no_slots()

    def reset(self) -> None:
        pass

    def check(self) -> None:
        """Nothing of its own to check: it holds no slots."""

    def cache_unfinished_req(self, req: Req) -> None:
        """Between chunks the row simply stays with the request."""

    def _keep_pages(self, req: Req, row: torch.Tensor) -> int:
        return 0  # nothing is kept: the whole row goes back to the allocator
