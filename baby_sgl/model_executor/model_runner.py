"""Loads the model, owns the KV pools and the attention backend, and runs one forward pass."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from baby_sgl.attention.registry import create_attention_backend
from baby_sgl.mem_cache.memory_pool import KVPool, ReqToTokenPool
from baby_sgl.model_config import ModelConfig
from baby_sgl.model_executor.forward_batch import ForwardBatch, ForwardMode
from baby_sgl.models.registry import get_model_class

logger = logging.getLogger(__name__)


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


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights, dtype: torch.dtype, device: torch.device,
                 attention_backend: str = "torch_native") -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, device
        with torch.device("meta"):
            model = get_model_class(cfg)(cfg)
        # Built on the meta device so no time goes into random initialisation.
        model = model.to_empty(device=device)
        model.tie_weights()
        model.load_weights(weights)
        self.model = model.to(dtype).eval()
        self.attn_backend = create_attention_backend(attention_backend)
        self.req_to_token_pool: ReqToTokenPool | None = None
        self.kv_pool: KVPool | None = None

    def init_memory_pool(self, max_total_tokens: int, max_running_requests: int, context_len: int) -> None:
        cfg = self.cfg
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, context_len, self.device)
        self.kv_pool = KVPool(max_total_tokens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)

    def forward(self, b: ModelWorkerBatch) -> torch.Tensor:
        dev = self.device
        fb = ForwardBatch(
            mode=b.mode,
            input_ids=torch.tensor(b.input_ids, dtype=torch.long, device=dev),
            positions=b.positions.to(dev),
            out_cache_loc=b.out_cache_loc.to(dev),
            req_pool_indices=torch.tensor(b.req_pool_indices, dtype=torch.long, device=dev),
            seq_lens=torch.tensor(b.seq_lens, dtype=torch.long, device=dev),
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            seq_lens_cpu=b.seq_lens,
            extend_prefix_lens_cpu=b.extend_prefix_lens,
            extend_seq_lens_cpu=b.extend_seq_lens,
        )
        self.attn_backend.init_forward_metadata(fb)
        return self.model(fb)
