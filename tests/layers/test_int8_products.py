"""The CPU kernel's products with activations rounded to int8 blocks (cpu/csrc/int8_products.h, the
decode step's --cpu-int8-activations) against a plain reference: the weights dequantized times
the activations quantized as llama.cpp's Q8 blocks and dequantized, in float64. Built for this
CPU (AVX-512 VNNI where it has it) and, on x86, for AVX2 (x86-64-v3) and for no SIMD (x86-64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize, quantize

from baby_sgl.layers.quantization import WeightType

TYPES = {G.Q8_0: WeightType.Q8_0, G.Q4_0: WeightType.Q4_0, G.Q4_1: WeightType.Q4_1}
N = 67  # an odd share of columns per thread


def _weight(kind: G, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = np.random.default_rng(k).standard_normal((N, k)).astype(np.float32)
    blocks = quantize(w, kind)
    return torch.from_numpy(blocks), torch.from_numpy(dequantize(blocks, kind).reshape(N, k).astype(np.float64))


def q8_dequantized(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as Q8 blocks of 32 and back, in float64: d = max|x| / 127, q = round(x / d) (half
    to even, the product x * (1 / d) rounded to float32 first)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv).double() * d.double()).reshape(x.shape)


def _activations(rows: int, k: int) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows * k))
    x[-1, -32:] *= 1e3  # a block of large values beside small ones
    if k > 32:
        x[0, :32] = 0.0  # an all-zero block: scale 0
    return x


@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("k", [32, 96, 288])  # one block; odd counts of blocks
# Where the CPU has AVX-512 VNNI, int8_gemm.h: 1 row by product_int8_row, more by tiles of 4 rows
# by 2 groups of 16 columns, then the tails (N = 67 is 4 whole groups and one of 3); elsewhere
# int8_products.h's tiles.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 11])
def test_int8_products_equal_float64_on_the_rounded_activations(ops, kind, k, rows):
    data, ref = _weight(kind, k)
    x = _activations(rows, k)
    bias = torch.randn(N)
    out = ops.linear_int8(x, data, int(TYPES[kind]), N, k, bias)
    expected = q8_dequantized(x) @ ref.T + bias.double()
    # float32 scales and sums over at most 9 blocks: a few ulps of the largest partial sum.
    scale = (q8_dequantized(x).abs() @ ref.abs().T).max()
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6 * scale.item())
    # The rounding is real: the float32 product of the unrounded activations differs.
    assert not torch.allclose(out.double(), x.double() @ ref.T + bias.double(), rtol=0, atol=1e-5 * scale.item())


@pytest.mark.parametrize("rows", [1, 4])
def test_activations_halfway_between_two_integers_round_to_even(ops, rows):
    """q = round(x / d) rounds half to even, as llama.cpp's Q8 blocks do (the SIMD conversions,
    nearbyint without SIMD): blocks whose largest magnitude is 127 times a power of two have that
    power of two as their scale, and their values 0.5, 1.5, 2.5, -2.5 ... times it land exactly
    between two integers, where rounding half away from zero (std::round) moves every other one by
    one. Random activations never land on such a tie."""
    k = 64
    data, ref = _weight(G.Q8_0, k)
    ties = torch.arange(31) - 15 + 0.5  # -14.5 .. 15.5
    block = torch.cat([torch.tensor([127.0]), ties])
    x = torch.stack([torch.cat([block, -2 * block]) * 2.0**m for m in range(rows)])
    assert q8_dequantized(x)[0, 14:19].tolist() == [-2.0, 0.0, 0.0, 2.0, 2.0]  # -1.5, -0.5, 0.5, 1.5, 2.5
    out = ops.linear_int8(x, data, int(WeightType.Q8_0), N, k, None)
    expected = q8_dequantized(x) @ ref.T
    scale = (q8_dequantized(x).abs() @ ref.abs().T).max()
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6 * scale.item())


@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_int8_result_does_not_depend_on_its_batch(ops, kind, dtype):
    """A row alone gives the bits it gets among 22 others: on CPUs with AVX-512 VNNI one row takes
    product_int8_row, which adds up as the many-row tiles do (it once took int8_products.h's tile,
    whose sums round differently: int8_gemm.h's products of one row then differed)."""
    data, _ = _weight(kind, 96)
    bias = torch.randn(N)
    x = torch.randn(23, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    batched = ops.linear_int8(x, data, int(TYPES[kind]), N, 96, bias)
    for i in range(23):
        assert torch.equal(ops.linear_int8(x[i : i + 1], data, int(TYPES[kind]), N, 96, bias), batched[i : i + 1])


@pytest.mark.parametrize("rows", [1, 6])
def test_bfloat16_activations_are_rounded_from_their_own_values(ops, rows):
    """A bfloat16 x (the engine's dtype) gives what its values widened to float32 give, in bfloat16."""
    data, _ = _weight(G.Q4_0, 96)
    x = _activations(rows, 96).bfloat16()
    out = ops.linear_int8(x, data, int(WeightType.Q4_0), N, 96, None)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ops.linear_int8(x.float(), data, int(WeightType.Q4_0), N, 96, None).bfloat16())


def test_int8_products_refuse_dense_weights(ops):
    with pytest.raises(RuntimeError, match="block-quantized"):
        ops.linear_int8(torch.randn(1, 32), torch.randn(N, 32), int(WeightType.F32), N, 32, None)
