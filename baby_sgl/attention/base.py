"""The interface an attention backend implements; the model only ever calls these two methods."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from baby_sgl.model_executor.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Precomputes per-pass data (KV slot tables, masks) once, before the layers run."""

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, fb: ForwardBatch) -> torch.Tensor:
        """q: [T, H, D] for the new tokens, whose K/V are already written to the pool.
        Returns [T, H, D]: each query attends to its request's KV slots 0..its own position."""
