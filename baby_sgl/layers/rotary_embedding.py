"""Rotary position embedding (rotate-half layout), with linear, llama3 and longrope (Phi-3) frequency
scaling, over the whole head or (partial rotary, Phi-4-mini) its first values."""

from __future__ import annotations

import math

import torch
from torch import nn


def _kind(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = _kind(scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear" and scaling is not None:
        return inv_freq / scaling["factor"]
    if kind == "llama3" and scaling is not None:
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "longrope" and scaling is not None:
        # Phi-3: a factor per frequency, the long set when the served context passes the
        # pre-training one (ModelConfig resolves which: "long").
        factors = torch.tensor(scaling["long_factor" if scaling["long"] else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    raise ValueError(f"unsupported rope scaling type {kind!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        # Plain float32 attributes, not buffers: built on the CPU even when the model is created
        # on the meta device, and never cast to the model's dtype (positions stay exact).
        with torch.device("cpu"):
            inv_freq = _inv_freq(head_dim, theta, scaling)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # rotate_half(x) = cat(-x2, x1) equals roll(x, D/2) * (-1 on the first half), exactly:
        # the sign is folded into the sine table, so applying rope is roll, two muls and an add.
        # longrope scales both tables by its attention factor, as transformers does.
        mscale = (scaling or {}).get("attention_factor", 1.0) if _kind(scaling) == "longrope" else 1.0
        self.cos_cache = torch.cat((freqs, freqs), dim=-1).cos() * mscale
        self.sin_cache = torch.cat((-freqs.sin(), freqs.sin()), dim=-1) * mscale

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables for one forward pass, [T, 1, D] each; every layer reuses them."""
        if self.cos_cache.device != positions.device:
            self.cos_cache, self.sin_cache = self.cos_cache.to(positions.device), self.sin_cache.to(positions.device)
        return self.cos_cache[positions].unsqueeze(1).to(dtype), self.sin_cache[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, heads, D] (queries and keys together), rotated to their positions; with tables
        narrower than D only the first values rotate and the rest pass through."""
        cos, sin = cos_sin
        rot = cos.shape[-1]
        if rot == x.shape[-1]:
            return x * cos + x.roll(rot // 2, dims=-1) * sin
        head = x[..., :rot]
        return torch.cat([head * cos + head.roll(rot // 2, dims=-1) * sin, x[..., rot:]], dim=-1)
