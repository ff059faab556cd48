"""The MLP's activation: SiLU(gate) * up (GELU-tanh for Gemma) over the fused gate/up
projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baby_sgl.cpu.ops import cpu_ops

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]. On CPU our kernel makes one pass over the rows (torch's ops make three),
    rounding as they do; compiled graphs and other devices take torch's ops."""
    if gate_up.device.type == "cpu" and gate_up.dim() == 2 and gate_up.dtype in _KERNEL_DTYPES \
            and not torch.compiler.is_compiling() and (ops := cpu_ops()) is not None:
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: GELU (tanh approximation) of the gate times up (Gemma)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
