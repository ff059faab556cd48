"""One forward pass as the scheduler hands it over (ModelWorkerBatch: host data) and as the model
runs it (ForwardBatch: device tensors plus a few host-side lengths for loop bounds), and the
interface of the attention backend a ForwardBatch carries."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from baby_sgl.core.memory_pool import KVPool, ReqToTokenPool


class ForwardMode(enum.Enum):
    EXTEND = enum.auto()  # prefill of the uncached suffix (possibly one chunk of it)
    DECODE = enum.auto()  # one new token per running request
    # --enable-mixed-chunk: extend requests first, then running requests decoding one token each
    MIXED = enum.auto()


@dataclass
class ModelWorkerBatch:
    """Only what the forward pass needs, as host data; the runner moves it to the device."""

    mode: ForwardMode
    input_ids: list[int]
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: list[int]
    seq_lens: list[int]
    extend_prefix_lens: list[int]
    extend_seq_lens: list[int]
    num_decode_reqs: int = 0  # MIXED: requests at the end of the batch that decode one token
    input_logprob_rows: list[int] | None = None  # token rows whose logits give prompt logprobs
    # Each entry of seq_lens's LoRA adapter (None: the base model); empty: none at all.
    lora_ids: list[str | None] = field(default_factory=list)


class LoRADelta(Protocol):
    """A pass's LoRA adapters (lora/memory_pool.py's LoRABatch), as the model applies them."""

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y, the product of x with the module's base weight, plus each row's adapter delta."""


class AttentionBackend(Protocol):
    """What an attention backend implements; the model only ever calls these two methods."""

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Precomputes per-pass data (KV slot tables, masks) once, before the layers run."""

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, fb: ForwardBatch,
                windowed: bool = False) -> torch.Tensor:
        """q: [T, H, D] for the new tokens, whose K/V are already written to the pool.
        Returns [T, H, D]: each query attends to its request's KV slots 0..its own position
        (windowed: only the last sliding_window of them, the backend's setting)."""


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
    lora: LoRADelta | None = None  # the rows' LoRA adapters, if any row has one
    # Filled by the attention backend once per pass, shared by all layers.
    attn_metadata: Any = None
    attn_metadata_window: Any = None  # the same, for layers attending over a sliding window

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    def last_token_indices(self) -> torch.Tensor:
        """Row of the last computed token of each request, where its next-token logits come from."""
        if self.mode == ForwardMode.DECODE:
            return torch.arange(self.batch_size, device=self.input_ids.device)
        ends = torch.tensor(self.extend_seq_lens_cpu, device=self.input_ids.device).cumsum(0)
        return ends - 1
