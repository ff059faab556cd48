"""The K-quants (Q4_K, Q5_K, Q6_K), Q5_0 / Q5_1 and the i-quants in the int8 products
(--cpu-int8-activations): one activation row at a time (cpu/csrc/int8_products.h's tiles) and many
(int8_gemm.h, on CPUs with AVX-512 VNNI, in groups of 16 weight rows: N = 67 leaves a partial
group), against float64 products of the dequantized weights with the activations rounded to Q8
blocks. Q6_K's two scales per 32 values are applied to exact integer sums; it has no one-row tile,
so where the CPU has VNNI every row count of it takes int8_gemm.h (as of Q4_K and Q5_K); elsewhere
the products these tests ask for (same_bits_for_any_rows, the default) refuse it, and the default
mode's kquant_rows.h and int8_panels.h take it (test_kquant_rows.py, test_int8_panels.py)."""

from __future__ import annotations

import pytest
import torch

from baby_sgl.layers.quantization import QuantizedWeight, WeightType
from test_int8_products import _activations, q8_dequantized
from test_kquant_kernels import N, _encoded, _random_blocks, _reference

TYPES = [WeightType.Q4_K, WeightType.Q5_K, WeightType.Q6_K, WeightType.Q5_0, WeightType.Q5_1, WeightType.IQ4_NL,
         WeightType.IQ4_XS]
K_QUANTS = [WeightType.Q4_K, WeightType.Q5_K, WeightType.Q6_K]
K = 768  # three super-blocks: 24 blocks of 32


def _has_products(ops, qtype: WeightType) -> bool:
    """Whether this build multiplies qtype in int8 with the same bits for any rows; where it does
    not (Q6_K without AVX-512 VNNI: those products are int8_gemm.h's), it must refuse by name."""
    if qtype != WeightType.Q6_K or ops.has_int8_gemm:
        return True
    qw = _random_blocks(WeightType.Q6_K, k=K)
    with pytest.raises(RuntimeError, match="Q6_K: with AVX-512 VNNI"):
        ops.linear_int8(torch.randn(1, K), qw.data, int(WeightType.Q6_K), N, K, None)
    return False


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("make", [_random_blocks, _encoded])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 11])
def test_int8_products_equal_float64_on_the_rounded_activations(ops, qtype, make, rows):
    if not _has_products(ops, qtype):
        return
    qw = make(qtype, k=K, seed=rows)
    ref = _reference(qw.data.numpy(), qtype, N, K).double()
    x = _activations(rows, K)
    bias = torch.randn(N)
    out = ops.linear_int8(x, qw.data, int(qtype), N, K, bias)
    expected = q8_dequantized(x) @ ref.T + bias.double()
    # float32 scales and sums over 24 blocks: a few ulps of the largest partial sum.
    scale = (q8_dequantized(x).abs() @ ref.abs().T).max()
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=4e-6 * scale.item())


@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_int8_result_does_not_depend_on_its_batch(ops, qtype):
    """Within each kernel: where the CPU has AVX-512 VNNI, int8_gemm.h takes two rows and more
    (pairs, then); elsewhere every count takes the one-row tiles."""
    if not _has_products(ops, qtype):
        return
    qw = _random_blocks(qtype, k=K, seed=3)
    x = _activations(11, K)
    batched = ops.linear_int8(x, qw.data, int(qtype), N, K, None)
    size = 2 if ops.has_int8_gemm else 1
    for i in range(0, 11 - size + 1, size):
        assert torch.equal(ops.linear_int8(x[i : i + size], qw.data, int(qtype), N, K, None), batched[i : i + size])


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_one_row_and_eleven_rows_give_the_same_bits(ops, qtype):
    if not _has_products(ops, qtype):
        return
    qw = _random_blocks(qtype, k=K, seed=4)
    x = _activations(11, K)
    batched = ops.linear_int8(x, qw.data, int(qtype), N, K, None)
    for i in range(11):
        assert torch.equal(ops.linear_int8(x[i : i + 1], qw.data, int(qtype), N, K, None)[0], batched[i])


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_a_q6_k_weight_takes_int8_products_where_the_cpu_has_them(ops, rows):
    """A Q4_K_M file's Q6_K tensors: with int8 activations a layer's product is the rounded one
    (quantization.py: QuantizedWeight.matmul sent Q6_K to the float products, INT8_TYPES) where
    the CPU has AVX-512 VNNI. Elsewhere the one-to-three-row int8 tiles refuse Q6_K, and a layer's
    product of one to three rows must take the float products (INT8_TYPES leaves Q6_K out), not fail."""
    qw = _random_blocks(WeightType.Q6_K, k=K, seed=5)
    layer = QuantizedWeight(qw.data, WeightType.Q6_K, (N, K), int8_activations=True)
    x = _activations(rows, K)
    out = layer.matmul(x)
    float_products = ops.linear(x, qw.data, int(WeightType.Q6_K), N, K, None)
    if not _has_products(ops, WeightType.Q6_K):
        assert torch.equal(out, float_products)
        return
    assert torch.equal(out, ops.linear_int8(x, qw.data, int(WeightType.Q6_K), N, K, None))
    assert not torch.equal(out, float_products)
