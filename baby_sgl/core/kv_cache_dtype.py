"""The KV pool's element types (--kv-cache-dtype) and how keys and values are rounded to them.

fp8 (e4m3, e5m2) and int8 elements carry a float32 scale per token and KV head, computed from the
values it covers when they are written (the head's largest magnitude maps to the type's largest
value) and stored beside the pool. A scale fixed per layer or head (SGLang's k_scale / v_scale,
1.0 unless a checkpoint calibrates them) clips any later key larger than what it was set for, or
leaves most of the range unused for small ones; a running maximum would have to rescale what is
already stored. Per token, nothing written later changes or clips an
earlier entry, and every entry keeps the type's full relative precision: int8 is within half a
step of amax / 127 of its head's values, e4m3 within 2^-4 of each value relative, e5m2 2^-3. It
costs 4 bytes per head and token beside 1 byte per value (a 64-value head: 68 bytes, not 128 in
bfloat16).

Attention reads the stored bytes and widens them in registers (cpu/csrc/kv_elements.h); the
portable path widens only the rows it gathers (widen).
"""

from __future__ import annotations

import torch

# --kv-cache-dtype's names (SGLang's, plus int8) and the element each stores; auto is the model's dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float32": torch.float32,
    "fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8,
}

# The largest magnitude each scaled type stores (int8 symmetric: -127 .. 127).
_LARGEST = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def resolve(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def is_scaled(dtype: torch.dtype) -> bool:
    """Stored with a scale per token and head (the 1-byte types)."""
    return dtype in _LARGEST


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] as dtype's elements and one float32 scale per row of D values (x ~= q * scale).
    The CPU step's write (kv_elements.h quantize_head) rounds the same way."""
    x = x.float()
    largest = _LARGEST[dtype]
    amax = x.abs().amax(-1)
    scale = torch.where(amax > 0, amax / largest, torch.ones_like(amax))
    y = (x / scale.unsqueeze(-1)).clamp_(-largest, largest)
    return (y.round_() if dtype == torch.int8 else y).to(dtype), scale


def widen(stored: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Gathered rows [..., D] of the pool (scales [...], or None for an unscaled type) as dtype."""
    if scales is None:
        return stored.to(dtype)
    return (stored.float() * scales.unsqueeze(-1)).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 viewed as uint8: torch's CPU index_copy_ does not take fp8 (2.13)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
