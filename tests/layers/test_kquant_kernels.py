"""The CPU kernel over the K-quants (Q4_K, Q5_K, Q6_K), Q5_0 / Q5_1 and the i-quants (IQ4_NL,
IQ4_XS): decoded values bit for bit the `gguf` package's, through the kernel and through the
portable torch path, on random blocks (any bytes are a valid block once the fp16 scales are
finite) and on blocks encoded from weights; products equal float64 products over those values
within float32 rounding, with float32 activations (int8-rounded ones: test_kquant_products.py);
a row's result does not depend on its batch. Built for this CPU and, on
x86, for AVX2 and for no SIMD at all (the `ops` fixture)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize

from baby_sgl.layers.quantization import BLOCK_BYTES, QuantizedWeight, WeightType, block_values, dequantize_blocks
from kquant_encoder import encode

TYPES = [WeightType.Q4_K, WeightType.Q6_K, WeightType.Q5_0, WeightType.Q5_1, WeightType.Q5_K, WeightType.IQ4_NL,
         WeightType.IQ4_XS]
# Where each block keeps its fp16 scales (d, and dmin or m).
_SCALES = {WeightType.Q4_K: (0, 2), WeightType.Q5_K: (0, 2), WeightType.Q6_K: (208,), WeightType.Q5_0: (0,),
           WeightType.Q5_1: (0, 2), WeightType.IQ4_NL: (0,), WeightType.IQ4_XS: (0,)}
N, K = 67, 512  # 67: an odd share of rows per thread


def _reference(data: np.ndarray, qtype: WeightType, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(data, G[qtype.name]).reshape(n, k).astype(np.float32))


def _random_blocks(qtype: WeightType, n: int = N, k: int = K, seed: int = 0) -> QuantizedWeight:
    """Random bytes, with finite fp16 scales of about 1e-2 (so the values are of order 1)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // block_values(qtype), BLOCK_BYTES[qtype]), dtype=np.uint8)
    for at in _SCALES[qtype]:
        scales = (rng.standard_normal(blocks.shape[:2]) * 1e-2).astype(np.float16)
        blocks[..., at : at + 2] = scales[..., None].view(np.uint8)
    return QuantizedWeight(torch.from_numpy(blocks.reshape(n, -1)), qtype, (n, k))


def _encoded(qtype: WeightType, n: int = N, k: int = K, seed: int = 0) -> QuantizedWeight:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return QuantizedWeight(torch.from_numpy(encode(w, G[qtype.name])), qtype, (n, k))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("make", [_random_blocks, _encoded])
def test_decoded_values_equal_the_gguf_package(ops, qtype, make):
    qw = make(qtype)
    ref = _reference(qw.data.numpy(), qtype, N, K)
    assert torch.equal(qw.dequantize(torch.float32), ref)
    assert torch.equal(dequantize_blocks(qw.data, qw.qtype, K), ref)  # the portable path
    rows = torch.tensor([5, 0, N - 1, 5])
    assert torch.equal(qw.dequantize(torch.float32, rows), ref[rows])
    assert torch.equal(qw.dequantize(torch.bfloat16), ref.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 33])  # tiles, then panels (from 8 rows on AVX2, 16 on AVX-512)
def test_products_equal_float64_on_the_dequantized_weights(ops, qtype, rows):
    qw = _random_blocks(qtype)
    ref = _reference(qw.data.numpy(), qtype, N, K)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(N)
    out = ops.linear(x, qw.data, int(qw.qtype), N, K, bias)
    expected = (x.double() @ ref.double().T + bias.double()).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_result_does_not_depend_on_its_batch(ops, qtype):
    """From 4 rows bfloat16 activations take bfloat16 products where the CPU has them (float32
    elsewhere, and for fewer rows): those rows are compared with tiles of 4."""
    qw = _random_blocks(qtype, seed=1)
    for dtype, sizes in ((torch.float32, (1, 4)), (torch.bfloat16, (4,))):
        x = torch.randn(40, K, generator=torch.Generator().manual_seed(7)).to(dtype)
        batched = ops.linear(x, qw.data, int(qw.qtype), N, K, None)  # by panels
        for i in range(0, 36, 7):
            for size in sizes:
                assert torch.equal(ops.linear(x[i : i + size], qw.data, int(qw.qtype), N, K, None)[0], batched[i])


def test_rows_of_partial_super_blocks_are_refused(ops):
    qw = _random_blocks(WeightType.Q4_K, k=256)
    with pytest.raises(RuntimeError, match="whole 256-value blocks"):
        ops.linear(torch.randn(1, 288), qw.data, int(qw.qtype), N, 288, None)
