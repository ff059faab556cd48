"""Request slots (rows of KV slot indices) and the per-layer K/V buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baby_sgl.core import kv_cache_dtype
from baby_sgl.cpu.ops import cpu_ops
from baby_sgl.errors import MemoryLeakError


class ReqToTokenPool:
    """Maps a request slot to the row of KV slot indices holding its tokens, in position order."""

    def __init__(self, size: int, max_context_len: int, device: torch.device, journal: bool = False) -> None:
        self.size = size
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int64, device=device)
        self.free_slots = list(range(size))
        # Tensor parallelism, rank 0: the writes since the last pass, for the other ranks' copies.
        # (Lists of ints: they pickle several times faster than small tensors.)
        self.journal: list[tuple[int, int, list[int]]] | None = [] if journal else None

    def alloc(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free(self, slot: int) -> None:
        assert slot not in self.free_slots, f"request slot {slot} freed twice"
        self.free_slots.append(slot)

    def used(self) -> int:
        """Request slots held (by running requests and by sessions between turns)."""
        return self.size - len(self.free_slots)

    def check(self) -> None:
        """Its own integrity: each free request slot once, and inside the pool."""
        if len(set(self.free_slots)) != len(self.free_slots) or any(not 0 <= s < self.size for s in self.free_slots):
            raise MemoryLeakError(f"the free request slots are broken: {sorted(self.free_slots)[:10]}...")

    def write(self, slot: int, start: int, indices: torch.Tensor) -> None:
        self.req_to_token[slot, start : start + len(indices)] = indices
        if self.journal is not None:
            self.journal.append((slot, start, indices.tolist()))

    def take_journal(self) -> list[tuple[int, int, list[int]]]:
        writes, self.journal = self.journal, []
        assert writes is not None, "this pool keeps no journal"
        return writes

    def apply_writes(self, writes: list[tuple[int, int, list[int]]]) -> None:
        for slot, start, indices in writes:
            self.write(slot, start, torch.tensor(indices, dtype=torch.int64, device=self.req_to_token.device))


@dataclass
class LayerKV:
    """One layer's K and V buffers as the pool stores them, and a 1-byte pool's scales."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


class KVPool:
    """One K and one V buffer per layer, indexed by KV slot: [num_slots, num_kv_heads, head_dim] of
    cache_dtype (--kv-cache-dtype), and for the 1-byte types a float32 scale per slot and head
    beside each ([num_slots, num_kv_heads], see core/kv_cache_dtype.py). dtype: the model's, in
    which keys and values are written and read back."""

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, cache_dtype: torch.dtype | None = None) -> None:
        self.size, self.dtype = size, dtype
        self.cache_dtype = cache_dtype or dtype
        shape = (size, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=self.cache_dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=self.cache_dtype, device=device) for _ in range(num_layers)]
        scaled = kv_cache_dtype.is_scaled(self.cache_dtype)
        self.k_scales = [torch.ones(shape[:2], dtype=torch.float32, device=device) for _ in range(num_layers)] if scaled else []
        self.v_scales = [torch.ones(shape[:2], dtype=torch.float32, device=device) for _ in range(num_layers)] if scaled else []
        # On CPU a 1-byte pool is written by the kernel that rounds the decode step's writes, so a
        # slot holds the same bytes whichever pass wrote it; elsewhere by kv_cache_dtype.quantize,
        # which rounds the same way.
        self._store_op = cpu_ops() if scaled and torch.device(device).type == "cpu" else None

    def release(self) -> None:
        """Lets go of the buffers once nothing runs over them any more (the engine stopped)."""
        self.k_buffers, self.v_buffers, self.k_scales, self.v_scales = [], [], [], []

    def layer(self, layer_id: int) -> LayerKV:
        if not self.k_scales:
            return LayerKV(self.k_buffers[layer_id], self.v_buffers[layer_id], None, None)
        return LayerKV(self.k_buffers[layer_id], self.v_buffers[layer_id], self.k_scales[layer_id],
                       self.v_scales[layer_id])

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self.k_scales:
            self.k_buffers[layer_id].index_copy_(0, loc, k.to(self.cache_dtype))
            self.v_buffers[layer_id].index_copy_(0, loc, v.to(self.cache_dtype))
            return
        for x, buffers, scales in ((k, self.k_buffers, self.k_scales), (v, self.v_buffers, self.v_scales)):
            if self._store_op is not None:
                self._store_op.store_kv(x.float().contiguous(), loc.contiguous(), buffers[layer_id], scales[layer_id])
                continue
            q, scale = kv_cache_dtype.quantize(x, self.cache_dtype)
            kv_cache_dtype.as_bytes(buffers[layer_id]).index_copy_(0, loc, kv_cache_dtype.as_bytes(q))
            scales[layer_id].index_copy_(0, loc, scale)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype) -> int:
        """K and V of every layer, scales included: the pool's bytes are its budget over this."""
        per_head = head_dim * cache_dtype.itemsize + (4 if kv_cache_dtype.is_scaled(cache_dtype) else 0)
        return 2 * num_layers * num_kv_heads * per_head
