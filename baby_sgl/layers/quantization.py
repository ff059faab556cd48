"""Weights kept as GGUF stores them (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL blocks of 32 values;
Q4_K, Q5_K, Q6_K and IQ4_XS super-blocks of 256), multiplied without a full-precision copy by our
CPU kernel (cpu/csrc/weights.h, the formats in cpu/csrc/formats.h), which widens each block in
registers and accumulates in float32: the same math as a float32 product over the dequantized
weights, up to the order of the sums. With int8 activations on CPUs with AVX-512 VNNI, Q8_0, Q4_0,
Q4_1 and Q4_K matrices are kept in groups of sixteen rows (the file's bytes rearranged at load:
QuantizedWeight.in_groups), as the kernel's int8 products read them.

`--quantization` (SGLang's flag): by default a GGUF's quantized tensors are served as they are
wherever the kernel runs (a CPU with a C++ compiler, no tensor parallelism, no torch.compile);
`none` dequantizes them to the model's dtype at load, as does every other case.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
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
    Q5_0 = 5
    Q5_1 = 6
    Q4_K = 7
    Q5_K = 8
    Q6_K = 9
    IQ4_NL = 10
    IQ4_XS = 11


BLOCK_BYTES = {WeightType.Q8_0: 34, WeightType.Q4_0: 18, WeightType.Q4_1: 20, WeightType.Q5_0: 22,
               WeightType.Q5_1: 24, WeightType.Q4_K: 144, WeightType.Q5_K: 176, WeightType.Q6_K: 210,
               WeightType.IQ4_NL: 18, WeightType.IQ4_XS: 136}
SUPER_BLOCK_TYPES = {WeightType.Q4_K, WeightType.Q5_K, WeightType.Q6_K, WeightType.IQ4_XS}


def block_values(qtype: WeightType) -> int:
    """Values per block: 256 for the super-block formats, else 32."""
    return 256 if qtype in SUPER_BLOCK_TYPES else 32


DENSE_WEIGHT_TYPES = {WeightType.F32, WeightType.BF16}
DENSE_TYPES = {torch.float32: WeightType.F32, torch.bfloat16: WeightType.BF16}

# From this many activation rows the matrix is dequantized for torch's GEMM, which is then the
# faster (2-core Zen 5, Q4_1 576->3072, 1536->576, 576->960; our kernel's AVX-512 and AVX2
# builds against torch's): in float32 equal at 64 rows and 1.2-1.5x faster at 256; in bfloat16
# 0.7-1.0x at 128 rows and 1.0-1.2x at 256. Below, the kernel was up to 2x faster, and it is
# the only way for a decode step.
TORCH_GEMM_MIN_ROWS = {torch.float32: 64, torch.bfloat16: 256}


# Fewer rows than this take int8 activations on any CPU (cpu/csrc/int8_products.h: every block
# format but Q6_K); any number of rows on CPUs with AVX-512 VNNI (the kernel's many-row int8
# product, int8_gemm.h, every block format), which beat both our bfloat16 products and torch's
# GEMM over dequantized weights from 4 rows to 1000 (2-core Zen 4, Q4_0 2048 -> 8192 and 8192 -> 2048).
INT8_TILE_MAX_ROWS = 4
INT8_TYPES = set(BLOCK_BYTES) - {WeightType.Q6_K}

# Rows stored in groups of sixteen (cpu/csrc/int8_groups.h): each block's sixteen rows' fields side
# by side, the layout the kernel's int8 products take on CPUs with AVX-512 VNNI, in the file's
# bytes. GROUPED_CODE is added to the format's code for the kernel; HEADER_BYTES are a block's
# halves (d, and Q4_1's m or Q4_K's dmin) ahead of the rest. (Q6_K stays as stored: read in place
# by one-row tiles it was faster, and the many-row products rearrange it anyway.)
GROUP_ROWS = 16
GROUPED_CODE = 256
HEADER_BYTES = {WeightType.Q8_0: 2, WeightType.Q4_0: 2, WeightType.Q4_1: 4, WeightType.Q4_K: 4}


@dataclass
class QuantizedWeight:
    """An [n, k] weight as rows of GGUF blocks: `data` is uint8 [n, k / block values * block bytes].
    int8_activations: products round the activations to int8 blocks first (--cpu-int8-activations;
    the decode step does the same)."""

    data: torch.Tensor
    qtype: WeightType
    shape: tuple[int, int]
    int8_activations: bool = False
    grouped: bool = False  # data is [n / 16, 16 rows' bytes]: rows in groups (GROUP_ROWS)
    matrix_tiles: bool = False  # bfloat16 batches go to the matrix tiles (--cpu-matrix-tiles)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Fused projections (q/k/v, gate/up): the parts' rows one after another."""
        assert len({(p.qtype, p.shape[1]) for p in parts}) == 1, "fused parts must share a format"
        return QuantizedWeight(torch.cat([p.ungrouped().data for p in parts]), parts[0].qtype,
                               (sum(p.shape[0] for p in parts), parts[0].shape[1]), parts[0].int8_activations)

    @property
    def code(self) -> int:
        """The format as the kernel takes it."""
        return int(self.qtype) + (GROUPED_CODE if self.grouped else 0)

    def can_group(self) -> bool:
        return self.qtype in HEADER_BYTES and self.shape[0] % GROUP_ROWS == 0

    def in_groups(self) -> QuantizedWeight:
        """The same weight with its rows in groups of sixteen (the same bytes, rearranged)."""
        if self.grouped:
            return self
        assert self.can_group(), "Q8_0, Q4_0, Q4_1 or Q4_K rows, a multiple of 16 of them"
        (n, k), bb, h = self.shape, BLOCK_BYTES[self.qtype], HEADER_BYTES[self.qtype]
        x = self.data.reshape(n // GROUP_ROWS, GROUP_ROWS, k // block_values(self.qtype), bb)
        # [group, block, field, row, bytes]: each field's sixteen rows side by side
        halves = x[..., :h].reshape(*x.shape[:3], h // 2, 2).permute(0, 2, 3, 1, 4)
        values = x[..., h:].reshape(*x.shape[:3], (bb - h) // 4, 4).permute(0, 2, 3, 1, 4)
        data = torch.cat([halves.flatten(2), values.flatten(2)], dim=2).reshape(n // GROUP_ROWS, -1)
        return QuantizedWeight(data, self.qtype, self.shape, self.int8_activations, grouped=True)

    def ungrouped(self) -> QuantizedWeight:
        """The same weight with one row of blocks per row, as GGUF stores it."""
        if not self.grouped:
            return self
        (n, k), bb, h = self.shape, BLOCK_BYTES[self.qtype], HEADER_BYTES[self.qtype]
        x = self.data.reshape(n // GROUP_ROWS, k // block_values(self.qtype), GROUP_ROWS * bb)
        halves = x[..., : GROUP_ROWS * h].reshape(*x.shape[:2], h // 2, GROUP_ROWS, 2).permute(0, 3, 1, 2, 4)
        values = x[..., GROUP_ROWS * h :].reshape(*x.shape[:2], (bb - h) // 4, GROUP_ROWS, 4).permute(0, 3, 1, 2, 4)
        data = torch.cat([halves.flatten(3), values.flatten(3)], dim=3).reshape(n, -1)
        return QuantizedWeight(data, self.qtype, self.shape, self.int8_activations)

    def select_rows(self, rows: torch.Tensor | slice) -> QuantizedWeight:
        data = self.ungrouped().data[rows]
        return QuantizedWeight(data, self.qtype, (data.shape[0], self.shape[1]), self.int8_activations)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        ops = cpu_ops() if self.data.device.type == "cpu" else None
        if ops is not None and dtype in (torch.float32, torch.bfloat16):
            return ops.dequantize(self.data, self.code, *self.shape, rows, dtype)
        if self.grouped:
            return self.ungrouped().dequantize(dtype, rows)
        return dequantize_blocks(self.data if rows is None else self.data[rows], self.qtype, self.shape[1]).to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        ops = cpu_ops()
        b = None if bias is None else bias.float().contiguous()
        # A bfloat16 batch on the matrix tiles, a panel of rows decoded at a time
        # (csrc/tile_products.h): no bfloat16 copy of the whole weight.
        if ops is not None and self.matrix_tiles and x.dtype == torch.bfloat16 and x.shape[0] >= ops.tile_min_rows:
            return ops.linear_tiles(x, self.data, self.code, *self.shape, b).to(torch.bfloat16)
        # (Grouped weights are made only where this holds: group_for_int8_products.)
        if (ops is not None and self.int8_activations
                and ((ops.has_int8_gemm and self.qtype in BLOCK_BYTES)
                     or (self.qtype in INT8_TYPES and x.shape[0] < INT8_TILE_MAX_ROWS))):
            return ops.linear_int8(x if x.dtype == torch.bfloat16 else x.float(), self.data, self.code, *self.shape, b)
        if ops is None or x.shape[0] >= TORCH_GEMM_MIN_ROWS.get(x.dtype, 0):
            return F.linear(x, self.dequantize(x.dtype), bias)
        return ops.linear(x, self.data, int(self.qtype), *self.shape, b)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


@dataclass
class FusedWeight:
    """A fused projection (q/k/v, gate/up) whose parts a file stores in different formats (a
    Q4_K_M file keeps v in Q6_K in some layers, q and k in Q4_K): each part as its own blocks,
    their outputs side by side."""

    parts: list[QuantizedWeight]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        biases = [None] * len(self.parts) if bias is None else bias.split([p.shape[0] for p in self.parts])
        return torch.cat([p.matmul(x, b) for p, b in zip(self.parts, biases)], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


StoredWeight = QuantizedWeight | FusedWeight


def fuse(parts: list[QuantizedWeight]) -> StoredWeight:
    """A fused projection from its parts: one run of blocks where they share a format."""
    assert len({p.shape[1] for p in parts}) == 1, "fused parts must have rows of one width"
    return QuantizedWeight.cat(parts) if len({p.qtype for p in parts}) == 1 else FusedWeight(parts)


def stored_parts(weight: StoredWeight) -> list[QuantizedWeight]:
    return weight.parts if isinstance(weight, FusedWeight) else [weight]


def group_for_int8_products(model: nn.Module) -> None:
    """Every stored Q8_0, Q4_0, Q4_1 and Q4_K matrix of `model` with its rows in groups of sixteen, for
    the int8 products of CPUs with AVX-512 VNNI (cpu/csrc/int8_groups.h): the same bytes, laid out
    as those products read them (a tied embedding and output head stay one matrix)."""
    from baby_sgl.layers.linear import set_quantized

    grouped: dict[int, StoredWeight] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, StoredWeight):
            continue
        if id(weight) not in grouped:
            parts = [p.in_groups() if p.can_group() else p for p in stored_parts(weight)]
            grouped[id(weight)] = parts[0] if isinstance(weight, QuantizedWeight) else FusedWeight(parts)
        set_quantized(module, grouped[id(weight)])


def _stored_matrices(model: nn.Module) -> Iterator[QuantizedWeight]:
    for module in model.modules():
        weight = getattr(module, "weight", None)
        for part in weight.parts if isinstance(weight, FusedWeight) else [weight]:
            if isinstance(part, QuantizedWeight):
                yield part


def round_activations_to_int8(model: nn.Module) -> None:
    """Every stored-block matrix of `model` multiplies int8-rounded activations (op by op as in
    the decode step: prefill and decode then round alike)."""
    for part in _stored_matrices(model):
        part.int8_activations = True


def use_matrix_tiles(model: nn.Module) -> None:
    """Every stored-block matrix of `model` multiplies bfloat16 batches on the matrix tiles (op by
    op as in the decode step)."""
    for part in _stored_matrices(model):
        part.matrix_tiles = True


def dequantize_blocks(data: torch.Tensor, qtype: WeightType, k: int) -> torch.Tensor:
    """The portable dequantization (torch ops): rows of blocks -> float32 [n, k], with the float32
    operations of the `gguf` package's dequantizers (so the same bits)."""
    blocks = data.reshape(-1, BLOCK_BYTES[qtype])
    return _DECODERS[qtype](blocks).reshape(-1, k)


def _halves(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """[..., 16 bytes] -> [..., 32] values: low halves, then high halves."""
    return torch.cat([b & 0x0F, b >> 4], dim=-1).int()


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """[..., count / 8 bytes] little-endian -> [..., count] bits."""
    bits = (qh.unsqueeze(-1).int() >> torch.arange(8, dtype=torch.int32, device=qh.device)) & 1
    return bits.reshape(*qh.shape[:-1], count)


def _shifts(b: torch.Tensor, *counts: int) -> torch.Tensor:
    """Bit shifts as an int32 tensor on b's device."""
    return torch.tensor(counts, dtype=torch.int32, device=b.device)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _halves(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _halves(b[:, :2]) * (_nibbles(b[:, 2:]) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _halves(b[:, :2]) * _nibbles(b[:, 4:]).float() + _halves(b[:, 2:4])


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _halves(b[:, :2]) * ((_nibbles(b[:, 6:]) | _high_bits(b[:, 2:6], 32) << 4) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _halves(b[:, :2]) * (_nibbles(b[:, 8:]) | _high_bits(b[:, 4:8], 32) << 4).float() + _halves(b[:, 2:4])


_IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                           dtype=torch.float32)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _halves(b[:, :2]) * _IQ4_VALUES.to(b.device)[_nibbles(b[:, 2:]).long()]


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's / Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and mins (as floats)."""
    s = s.int()
    lo, hi, mixed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 63, (mixed & 0x0F) | ((lo >> 6) << 4)], dim=-1)
    m = torch.cat([hi & 63, (mixed >> 4) | ((hi >> 6) << 4)], dim=-1)
    return sc.float(), m.float()


def _k_quant(b: torch.Tensor, high: torch.Tensor | None) -> torch.Tensor:
    """Q4_K (high None) or Q5_K: value = (d * sc) * q - dmin * m per sub-block of 32."""
    sc, m = _k4_scales(b[:, 4:16])
    scale = (_halves(b[:, 0:2]) * sc).unsqueeze(-1)
    offset = (_halves(b[:, 2:4]) * m).unsqueeze(-1)
    packed = b[:, -128:].reshape(-1, 4, 1, 32).int() >> _shifts(b, 0, 4).reshape(2, 1)
    q = (packed & 0x0F).reshape(-1, 8, 32)
    if high is not None:
        q = q | (high << 4)
    return (scale * q.float() - offset).reshape(-1, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_quant(b, None)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 16:48].int().unsqueeze(1) >> _shifts(b, *range(8)).reshape(8, 1)
    return _k_quant(b, qh & 1)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[:, :128].reshape(-1, 2, 1, 64).int() >> _shifts(b, 0, 4).reshape(2, 1)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32).int() >> _shifts(b, 0, 2, 4, 6).reshape(4, 1)
    q = ((ql & 0x0F).reshape(-1, 8, 32) | ((qh & 3).reshape(-1, 8, 32) << 4)) - 32
    scale = _halves(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()
    return (scale.unsqueeze(-1) * q.reshape(-1, 16, 16).float()).reshape(-1, 256)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    low = _nibbles(b[:, 4:8]).reshape(-1, 2, 4).transpose(1, 2).reshape(-1, 8)  # byte j: sub-blocks 2j, 2j + 1
    high = (b[:, 2:4].contiguous().view(torch.int16).int() >> _shifts(b, *range(0, 16, 2))) & 3
    scale = _halves(b[:, :2]) * ((low | high << 4) - 32).float()
    q = _IQ4_VALUES.to(b.device)[_nibbles(b[:, 8:].reshape(-1, 8, 16)).long()]
    return (scale.unsqueeze(-1) * q).reshape(-1, 256)


_DECODERS = {WeightType.Q8_0: _q8_0, WeightType.Q4_0: _q4_0, WeightType.Q4_1: _q4_1, WeightType.Q5_0: _q5_0,
             WeightType.Q5_1: _q5_1, WeightType.IQ4_NL: _iq4_nl, WeightType.Q4_K: _q4_k, WeightType.Q5_K: _q5_k,
             WeightType.Q6_K: _q6_k, WeightType.IQ4_XS: _iq4_xs}
