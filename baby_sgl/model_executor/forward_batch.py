"""What one forward pass needs, as device tensors (plus a few host-side lengths for loop bounds)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from baby_sgl.attention.base import AttentionBackend
    from baby_sgl.mem_cache.memory_pool import KVPool, ReqToTokenPool


class ForwardMode(enum.Enum):
    EXTEND = enum.auto()  # prefill of the uncached suffix (possibly one chunk of it)
    DECODE = enum.auto()  # one new token per running request
    # --enable-mixed-chunk: extend requests first, then running requests decoding one token each
    MIXED = enum.auto()


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] tokens computed now
    positions: torch.Tensor  # [T] absolute positions (invariant 1)
    out_cache_loc: torch.Tensor  # [T] KV slots the new tokens are written to
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] tokens with KV after this pass
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool
    attn_backend: AttentionBackend
    # Host copies: loop bounds and slicing must not force device syncs.
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    num_decode_reqs: int = 0  # MIXED: how many requests at the end of the batch decode
    input_logprob_rows: torch.Tensor | None = None  # token rows whose hidden states give prompt logprobs
    # Filled by the attention backend once per pass, shared by all layers.
    attn_metadata: Any = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    def last_token_indices(self) -> torch.Tensor:
        """Row of the last computed token of each request, where its next-token logits come from."""
        if self.mode == ForwardMode.DECODE:
            return torch.arange(self.batch_size, device=self.input_ids.device)
        ends = torch.tensor(self.extend_seq_lens_cpu, device=self.input_ids.device).cumsum(0)
        return ends - 1
