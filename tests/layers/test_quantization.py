"""The CPU kernel's products over stored weights (GGUF blocks, float32, bfloat16) against the
same weights dequantized, and its promise that a row's result does not depend on its batch; built
for this CPU and, on x86, also for AVX2 (x86-64-v3) and for the portable path (x86-64), so every
path is checked whatever the machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize, quantize

from baby_sgl.layers.quantization import QuantizedWeight, WeightType, dequantize_blocks

TYPES = {G.Q8_0: WeightType.Q8_0, G.Q4_0: WeightType.Q4_0, G.Q4_1: WeightType.Q4_1}
N, K = 200, 96


def _quantized(kind: G, n: int = N, k: int = K, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = quantize(w, kind)
    ref = torch.from_numpy(dequantize(blocks, kind).reshape(n, k).astype(np.float32))
    return QuantizedWeight(torch.from_numpy(blocks), TYPES[kind], (n, k)), ref


@pytest.mark.parametrize("kind", list(TYPES))
def test_dequantized_values_equal_the_gguf_package(ops, kind):
    qw, ref = _quantized(kind)
    assert torch.equal(qw.dequantize(torch.float32), ref)
    assert torch.equal(dequantize_blocks(qw.data, qw.qtype, K), ref)  # the portable path
    rows = torch.tensor([5, 0, 199, 5])
    assert torch.equal(qw.dequantize(torch.float32, rows), ref[rows])
    assert torch.equal(qw.dequantize(torch.bfloat16), ref.to(torch.bfloat16))


@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 33, 70])  # tiles, then panels (from 8 rows on AVX2, 16 on AVX-512)
# 768: 24 blocks, which the panels sum in two runs of 12 (weights.h: panel_tile), each run's
# partial sums carried into the next; rows of at most 16 blocks take one run.
@pytest.mark.parametrize("k", [K, 768])
def test_products_equal_float64_on_the_dequantized_weights(ops, kind, rows, k):
    qw, ref = _quantized(kind, k=k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(N)
    out = ops.linear(x, qw.data, int(qw.qtype), N, k, bias)
    expected = (x.double() @ ref.double().T + bias.double()).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("n", [N, 67])  # 67: an odd share of rows per thread
def test_a_rows_result_does_not_depend_on_its_batch(ops, kind, n):
    qw, _ = _quantized(kind, n=n)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(7))
    batched = ops.linear(x, qw.data, int(qw.qtype), n, K, None)  # by panels
    for i in range(11):
        assert torch.equal(ops.linear(x[i : i + 1], qw.data, int(qw.qtype), n, K, None)[0], batched[i])
        assert torch.equal(ops.linear(x[i : i + 5], qw.data, int(qw.qtype), n, K, None)[0], batched[i])
        # 17 rows go by panels in tiles of 4, 4, 4, 4 and 1 row: the last row meets the panels'
        # last columns (a thread's share of 67 leaves one) in a tile of one row by one column.
        assert torch.equal(ops.linear(x[i : i + 17], qw.data, int(qw.qtype), n, K, None)[16], batched[i + 16])


@pytest.mark.parametrize("kind", list(TYPES))
def test_bfloat16_rows_do_not_depend_on_their_batch(ops, kind):
    """From 4 rows bfloat16 activations take bfloat16 products where the CPU has them (float32
    elsewhere): 4-row tiles and 40-row panels give the same bits."""
    qw, _ = _quantized(kind)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    batched = ops.linear(x, qw.data, int(qw.qtype), N, K, None)
    for i in range(0, 36, 5):
        assert torch.equal(ops.linear(x[i : i + 4], qw.data, int(qw.qtype), N, K, None)[0], batched[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_weights_any_width(ops, dtype):
    k = 70  # not a whole number of blocks: the tail is summed apart
    w = torch.randn(N, k).to(dtype)
    x = torch.randn(3, k)
    out = ops.linear(x, w, int(WeightType.F32 if dtype == torch.float32 else WeightType.BF16), N, k, None)
    torch.testing.assert_close(out, x @ w.float().T, rtol=1e-5, atol=1e-4)


def test_bfloat16_activations_come_back_in_bfloat16(ops):
    qw, ref = _quantized(G.Q4_1)
    x = torch.randn(4, K).to(torch.bfloat16)
    out = qw.matmul(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), x.float() @ ref.T, rtol=2e-2, atol=0.1)  # bfloat16 rounding
    big = torch.randn(300, K).to(torch.bfloat16)  # past TORCH_GEMM_MIN_ROWS: dequantized for torch's GEMM
    torch.testing.assert_close(qw.matmul(big).float(), big.float() @ ref.T, rtol=2e-2, atol=0.1)


def test_bad_shapes_are_refused(ops):
    qw, _ = _quantized(G.Q8_0)
    with pytest.raises(RuntimeError, match="expected"):
        ops.linear(torch.randn(1, K), qw.data, int(WeightType.Q4_1), N, K, None)  # Q8_0 rows read as Q4_1
    with pytest.raises(RuntimeError, match="out of range"):
        qw.dequantize(torch.float32, torch.tensor([N]))
