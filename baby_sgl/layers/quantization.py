"""Weights kept as GGUF stores them (Q8_0, Q4_0, Q4_1 blocks of 32 values), multiplied without a
full-precision copy by our CPU kernel (cpu/csrc/weights.h), which widens each block in registers and
accumulates in float32: the same math as a float32 product over the dequantized weights, up to
the order of the sums.

`--quantization` (SGLang's flag): by default a GGUF's quantized tensors are served as they are
wherever the kernel runs (a CPU with a C++ compiler, no tensor parallelism, no torch.compile);
`none` dequantizes them to the model's dtype at load, as does every other case.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from baby_sgl.cpu.ops import cpu_ops


class WeightType(enum.IntEnum):
    """Row formats the CPU kernel reads (the codes of cpu/csrc/weights.h)."""

    F32 = 0
    BF16 = 1
    Q8_0 = 2
    Q4_0 = 3
    Q4_1 = 4


BLOCK_BYTES = {WeightType.Q8_0: 34, WeightType.Q4_0: 18, WeightType.Q4_1: 20}
DENSE_TYPES = {torch.float32: WeightType.F32, torch.bfloat16: WeightType.BF16}

# From this many activation rows the matrix is dequantized for torch's GEMM, which is then the
# faster (2-core Zen 5, Q4_1 576->3072, 1536->576, 576->960; our kernel's AVX-512 and AVX2
# builds against torch's): in float32 equal at 64 rows and 1.2-1.5x faster at 256; in bfloat16
# 0.7-1.0x at 128 rows and 1.0-1.2x at 256. Below, the kernel was up to 2x faster, and it is
# the only way for a decode step.
TORCH_GEMM_MIN_ROWS = {torch.float32: 64, torch.bfloat16: 256}


# Fewer rows than this take int8 activations on any CPU (cpu/csrc/int8_products.h); more only
# where the kernel has its many-row int8 product (int8_gemm.h: AVX-512 VNNI), which beat both
# our bfloat16 products and torch's GEMM over dequantized weights from 4 rows to 1000 (2-core
# Zen 4, Q4_0 2048 -> 8192 and 8192 -> 2048).
INT8_TILE_MAX_ROWS = 4


@dataclass
class QuantizedWeight:
    """An [n, k] weight as rows of GGUF blocks: `data` is uint8 [n, k / 32 * block bytes].
    int8_activations: products round the activations to int8 blocks first (--cpu-int8-activations;
    the decode step does the same)."""

    data: torch.Tensor
    qtype: WeightType
    shape: tuple[int, int]
    int8_activations: bool = False

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Fused projections (q/k/v, gate/up): the parts' rows one after another."""
        assert len({(p.qtype, p.shape[1]) for p in parts}) == 1, "fused parts must share a format"
        return QuantizedWeight(torch.cat([p.data for p in parts]), parts[0].qtype,
                               (sum(p.shape[0] for p in parts), parts[0].shape[1]), parts[0].int8_activations)

    def select_rows(self, rows: torch.Tensor | slice) -> QuantizedWeight:
        data = self.data[rows]
        return QuantizedWeight(data, self.qtype, (data.shape[0], self.shape[1]), self.int8_activations)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        ops = cpu_ops() if self.data.device.type == "cpu" else None
        if ops is not None and dtype in (torch.float32, torch.bfloat16):
            return ops.dequantize(self.data, int(self.qtype), *self.shape, rows, dtype)
        return dequantize_blocks(self.data if rows is None else self.data[rows], self.qtype, self.shape[1]).to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        ops = cpu_ops()
        if ops is not None and self.int8_activations and (x.shape[0] < INT8_TILE_MAX_ROWS or ops.has_int8_gemm):
            return ops.linear_int8(x if x.dtype == torch.bfloat16 else x.float(), self.data, int(self.qtype),
                                   *self.shape, None if bias is None else bias.float().contiguous())
        if ops is None or x.shape[0] >= TORCH_GEMM_MIN_ROWS.get(x.dtype, 0):
            return F.linear(x, self.dequantize(x.dtype), bias)
        return ops.linear(x, self.data, int(self.qtype), *self.shape, None if bias is None else bias.float().contiguous())

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def round_activations_to_int8(model: nn.Module) -> None:
    """Every stored-block matrix of `model` multiplies int8-rounded activations (op by op as in
    the decode step: prefill and decode then round alike)."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight):
            weight.int8_activations = True


def dequantize_blocks(data: torch.Tensor, qtype: WeightType, k: int) -> torch.Tensor:
    """The portable dequantization (torch ops): rows of blocks -> float32 [n, k]."""
    blocks = data.reshape(data.shape[0], k // 32, BLOCK_BYTES[qtype])
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    if qtype == WeightType.Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(-1, k)
    nibbles = blocks[..., -16:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
    if qtype == WeightType.Q4_0:
        return (d * (q - 8)).reshape(-1, k)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(-1, k)
