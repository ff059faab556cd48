from __future__ import annotations

import torch
from torch import nn

from baby_sgl.cpu.ops import cpu_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 and cast back before the weight, exactly as transformers does,
    # so bf16 outputs round the same way. On CPU our kernel does it in one pass over the rows.
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype == weight.dtype and x.dtype in _KERNEL_DTYPES \
            and not torch.compiler.is_compiling() and (ops := cpu_ops()) is not None:
        return ops.rms_norm(x, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: scaled by 1 + weight, multiplied in float32 before the cast back, as
    transformers does (Llama's casts first, then multiplies)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps, self.offset = eps, offset  # offset: Gemma's, scaled by 1 + weight
        self.fn = rms_norm_offset if offset else rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight, self.eps)
