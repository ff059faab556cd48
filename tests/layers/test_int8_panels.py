"""AVX2's many-row int8 products (cpu/csrc/int8_panels.h: panels of eight weight rows a lane group,
vpmaddubsw int16 sums widened before they can overflow), taken from four activation rows on where a
row's bits may depend on its batch (the decode step's default mode, same_bits_for_any_rows=False),
on every block format, against float64 products of the dequantized weights with the activations
rounded to Q8 blocks. Built for AVX2 (x86-64-v3, and this CPU's own build where it lacks AVX-512
VNNI, whose int8_gemm.h takes these products instead). A build without the panels (VNNI's, checked
against them in test_the_panels_give_the_vnni_kernels_bits; one without SIMD, which takes the
tiles) has nothing to test here: those tests return."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as G
from gguf.quants import quantize

from baby_sgl.layers.quantization import BLOCK_BYTES, WeightType
from helpers import ARCHS
from test_int8_products import _activations, q8_dequantized
from test_kquant_kernels import _encoded, _random_blocks, _reference

K = 768  # three super-blocks, 24 blocks of 32
N = 43  # five groups of eight and a group of three; with two threads, shares that split groups
# The formats test_kquant_kernels' _random_blocks makes, and the first block formats, made here.
RANDOM = [WeightType.Q5_0, WeightType.Q5_1, WeightType.Q4_K, WeightType.Q5_K, WeightType.Q6_K, WeightType.IQ4_NL,
          WeightType.IQ4_XS]
FIRST = {WeightType.Q8_0: (0,), WeightType.Q4_0: (0,), WeightType.Q4_1: (0, 2)}  # their float16 fields' bytes


def _weight(qtype: WeightType, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes with finite float16 scales of about 1e-2, and the weight dequantized by gguf."""
    if qtype in FIRST:
        rng = np.random.default_rng(seed)
        blocks = rng.integers(0, 256, (N, K // 32, BLOCK_BYTES[qtype]), dtype=np.uint8)
        for at in FIRST[qtype]:
            blocks[..., at : at + 2] = (rng.standard_normal(blocks.shape[:2]) * 1e-2).astype(np.float16)[..., None].view(np.uint8)
        data = torch.from_numpy(blocks.reshape(N, -1))
    else:
        data = _random_blocks(qtype, n=N, k=K, seed=seed).data
    return data, _reference(data.numpy(), qtype, N, K).double()


# Where each format's value bytes sit in its block (the scales' float16 fields stay as _weight made them).
VALUE_BYTES = {WeightType.Q4_0: (2, 18), WeightType.Q4_1: (4, 20), WeightType.Q5_0: (2, 22), WeightType.Q5_1: (4, 24),
               WeightType.Q4_K: (4, 144), WeightType.Q5_K: (4, 176), WeightType.Q6_K: (0, 192),
               WeightType.Q8_0: (2, 34), WeightType.IQ4_NL: (2, 18), WeightType.IQ4_XS: (8, 136)}


@pytest.mark.parametrize("qtype", list(FIRST) + RANDOM)
@pytest.mark.parametrize("rows", [4, 5, 7, 16])  # tiles of 2 rows and a row left over
def test_panel_products_equal_float64_on_the_rounded_activations(ops, qtype, rows):
    if not ops.has_int8_panels:  # see the module's docstring
        return
    data, ref = _weight(qtype, seed=rows)
    x = _activations(rows, K)
    x[1] *= 1e-3  # rows of different scales
    bias = torch.randn(N)
    out = ops.linear_int8(x, data, int(qtype), N, K, bias, same_bits_for_any_rows=False)
    expected = q8_dequantized(x) @ ref.T + bias.double()
    # Per output, float32 scales and sums over 24 blocks, each block's sum exact, then the bias: a
    # few ulps of the largest partial sum of that row (the bias's included).
    scale = (q8_dequantized(x).abs() @ ref.abs().T + bias.abs().double()).amax(1, keepdim=True)
    assert ((out.double() - expected).abs() / scale).max() < 4e-6


@pytest.mark.parametrize("qtype", [WeightType.Q8_0, WeightType.Q4_0, WeightType.Q4_K, WeightType.Q6_K])
@pytest.mark.parametrize("rows", [4, 5])
def test_a_partial_group_in_a_tiles_second_group_writes_only_its_own_columns(ops, qtype, rows):
    """One thread's 15 outputs are one tile of two groups, the second of 7 rows: each group's
    stores are masked to its own valid columns (product_int8_panels: valid[r] from group g + r), or
    the second group's eighth lane would land on the next row's first output (out's row stride is
    15). With two threads a share of two groups ending in a partial one writes its neighbour's
    columns too, but which write lands last is a race: one thread makes it certain."""
    if not ops.has_int8_panels:  # see the module's docstring
        return
    n = 15
    data, ref = _weight(qtype, seed=7)
    data, ref = data[:n].contiguous(), ref[:n]
    x = _activations(rows, K)
    bias = torch.randn(n)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = ops.linear_int8(x, data, int(qtype), n, K, bias, same_bits_for_any_rows=False)
    finally:
        torch.set_num_threads(threads)
    expected = q8_dequantized(x) @ ref.T + bias.double()
    scale = (q8_dequantized(x).abs() @ ref.abs().T + bias.abs().double()).amax(1, keepdim=True)
    assert ((out.double() - expected).abs() / scale).max() < 4e-6


@pytest.mark.parametrize("qtype", [WeightType.Q4_0, WeightType.Q4_K, WeightType.Q6_K])
def test_encoded_k_quants_too(ops, qtype):
    """Weights a quantizer made (not random bytes): the K-quants' scales and mins as encoders write them."""
    if not ops.has_int8_panels:  # see the module's docstring
        return
    if qtype == WeightType.Q4_0:
        w = np.random.default_rng(9).standard_normal((N, K)).astype(np.float32)
        data = torch.from_numpy(quantize(w, G.Q4_0))
        ref = _reference(data.numpy(), qtype, N, K).double()
    else:
        data = _encoded(qtype, n=N, k=K, seed=9).data
        ref = _reference(data.numpy(), qtype, N, K).double()
    x = _activations(6, K)
    out = ops.linear_int8(x, data, int(qtype), N, K, None, same_bits_for_any_rows=False)
    scale = (q8_dequantized(x).abs() @ ref.abs().T).amax(1, keepdim=True)
    assert ((out.double() - q8_dequantized(x) @ ref.T).abs() / scale).max() < 4e-6


@pytest.mark.parametrize("qtype", [WeightType.Q4_1, WeightType.Q8_0, WeightType.Q5_K, WeightType.Q6_K])
def test_a_rows_bits_are_the_same_in_any_batch_the_panels_take(ops, qtype):
    """Each output is its row's own sum in block order: the same bits with 4, 5 or 17 rows, in
    whichever tile the row falls."""
    if not ops.has_int8_panels:  # see the module's docstring
        return
    data, _ = _weight(qtype, seed=2)
    x = _activations(17, K)
    batched = ops.linear_int8(x, data, int(qtype), N, K, None, same_bits_for_any_rows=False)
    for start, size in [(0, 4), (3, 5), (12, 5), (1, 4)]:
        part = ops.linear_int8(x[start : start + size], data, int(qtype), N, K, None, same_bits_for_any_rows=False)
        assert torch.equal(part, batched[start : start + size])


def test_fewer_rows_and_the_same_bits_mode_keep_the_tiles(ops):
    """Three rows take int8_products.h's tiles, and so do 4 rows where every row count must give the
    same bits; the panels round differently from the tiles (a sum per block, not per vector)."""
    if not ops.has_int8_panels:  # see the module's docstring
        return
    data, _ = _weight(WeightType.Q4_0, seed=3)
    x = _activations(8, K)
    panels = ops.linear_int8(x, data, int(WeightType.Q4_0), N, K, None, same_bits_for_any_rows=False)
    tiles = ops.linear_int8(x, data, int(WeightType.Q4_0), N, K, None, same_bits_for_any_rows=True)
    assert not torch.equal(panels, tiles)
    three = ops.linear_int8(x[:3], data, int(WeightType.Q4_0), N, K, None, same_bits_for_any_rows=False)
    assert torch.equal(three, tiles[:3])


@pytest.mark.parametrize("qtype", list(VALUE_BYTES))
def test_the_largest_values_do_not_overflow_the_int16_sums(ops, qtype):
    """Every weight at its largest magnitude and every activation at +-127 with the sign that makes
    all products add up: the int16 sums reach their bound (4-bit values 8 x 2 x 15 x 127 = 30480,
    5-bit 4 x 2 x 31 x 127, Q6_K 2 x 2 x 63 x 127, signed bytes 2 x 128 x 127 = 32512), one more step
    (or a saturated pair) before widening would be far off."""
    if not ops.has_int8_panels:  # see the module's docstring
        return
    data, _ = _weight(qtype, seed=5)
    blocks = data.numpy().reshape(N, -1, BLOCK_BYTES[qtype]).copy()
    first, end = VALUE_BYTES[qtype]
    signed = qtype in (WeightType.Q8_0, WeightType.IQ4_NL, WeightType.IQ4_XS)
    # Unsigned formats: every bit set (nibbles 15, fifth bits 1, Q6_K's 63; the K-quants' 6-bit scales
    # and mins 63). Q8_0: -128; IQ4: nibble 0, the level -127.
    blocks[..., first:end] = 0x80 if qtype == WeightType.Q8_0 else 0x00 if signed else 0xFF
    data = torch.from_numpy(blocks.reshape(N, -1))
    ref = _reference(blocks.reshape(N, -1), qtype, N, K).double()
    x = torch.full((4, K), -1.0 if signed else 1.0)  # q = +-127 everywhere
    out = ops.linear_int8(x, data, int(qtype), N, K, None, same_bits_for_any_rows=False)
    expected = q8_dequantized(x) @ ref.T
    scale = (q8_dequantized(x).abs() @ ref.abs().T).amax(1, keepdim=True)
    assert ((out.double() - expected).abs() / scale).max() < 4e-6


@pytest.mark.cpu_only("the CPU kernels")
def test_the_panels_give_the_vnni_kernels_bits(monkeypatch):
    """On a CPU with AVX-512 VNNI, this CPU's build (int8_gemm.h) and the AVX2 build (these panels)
    give the same bits for the same rows: the same exact block sums, the same float operations in
    the same order. Elsewhere one of the two builds is missing and there is nothing to compare."""
    from helpers import build_for

    if "x86-64-v3" not in ARCHS:
        return
    native = build_for("native", monkeypatch)
    if not native.has_int8_gemm:
        return
    outs = {}
    for arch in ("native", "x86-64-v3"):
        ops = build_for(arch, monkeypatch)
        outs[arch] = {}
        for qtype in list(FIRST) + RANDOM:
            data, _ = _weight(qtype, seed=6)
            x = _activations(9, K)
            outs[arch][qtype] = ops.linear_int8(x, data, int(qtype), N, K, torch.ones(N), same_bits_for_any_rows=False)
    for qtype in outs["native"]:
        assert torch.equal(outs["native"][qtype], outs["x86-64-v3"][qtype]), qtype.name
