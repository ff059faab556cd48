"""Attention over the paged KV pool with torch's scaled_dot_product_attention (CPU and CUDA).

Decode is one batched call: every request's KV slots are gathered into a padded [B, L] table
and padding is masked. Extend loops over the requests of the batch (not over tokens): each
request's new queries attend to its cached prefix plus the causal part of its new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baby_sgl.model_executor.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _DecodeMeta:
    kv_indices: torch.Tensor  # [B, L] KV slots, padded
    mask: torch.Tensor  # [B, 1, 1, L] True where the slot belongs to the request


@dataclass
class _ExtendMeta:
    kv_indices: list[torch.Tensor]  # per request: its slots 0..seq_len-1
    masks: list[torch.Tensor | None]  # per request: None means plain causal (no cached prefix)


def _gather(buf: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """buf[indices] for any shape of indices; index_select is ~3x faster than advanced indexing
    on CPU (measured: 26 vs 90 us for 8 x 192 slots of [3, 64])."""
    return buf.index_select(0, indices.reshape(-1)).view(*indices.shape, *buf.shape[1:])


class TorchNativeAttnBackend:
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, : max(fb.seq_lens_cpu)]
        if fb.mode == ForwardMode.DECODE:
            cols = torch.arange(rows.shape[1], device=rows.device)
            mask = (cols[None, :] < fb.seq_lens[:, None])[:, None, None, :]
            fb.attn_metadata = _DecodeMeta(rows, mask)
            return
        indices, masks = [], []
        for i, (prefix, ext) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
            indices.append(rows[i, : prefix + ext])
            # Invariant 2: query j (absolute position prefix + j) sees keys 0..prefix + j.
            causal = None
            if prefix:
                causal = torch.ones(ext, prefix + ext, dtype=torch.bool, device=rows.device).tril(prefix)
            masks.append(causal)
        fb.attn_metadata = _ExtendMeta(indices, masks)

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, fb: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = fb.kv_pool.get_kv_buffer(layer_id)
        meta = fb.attn_metadata
        if fb.mode == ForwardMode.DECODE:
            k = _gather(k_buf, meta.kv_indices).transpose(1, 2)  # [B, Hkv, L, D]
            v = _gather(v_buf, meta.kv_indices).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), k, v, attn_mask=meta.mask, scale=scale, enable_gqa=True
            )
            return out.squeeze(2)
        outs, start = [], 0
        for idx, mask, ext in zip(meta.kv_indices, meta.masks, fb.extend_seq_lens_cpu):
            qi = q[start : start + ext].transpose(0, 1).unsqueeze(0)  # [1, H, ext, D]
            ki = _gather(k_buf, idx).transpose(0, 1).unsqueeze(0)
            vi = _gather(v_buf, idx).transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
            outs.append(oi[0].transpose(0, 1))
            start += ext
        return torch.cat(outs, dim=0)
