"""The matrix-tile products (cpu/csrc/tile_products.h): bfloat16 activations times stored weights
decoded a panel at a time, on AMX where the CPU has it and through torch's bfloat16 GEMM on the
same panels elsewhere, so their panels, tails and bias run on every CPU. Both accumulate exact
bfloat16 products in float32: the results are float64's on the bfloat16 operands within float32
rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize, quantize

from baby_sgl import Engine
from baby_sgl.layers.quantization import FusedWeight, QuantizedWeight, WeightType
from gguf_writer import write_tiny_gguf
from helpers import GREEDY, assert_bfloat16_close, random_prompts

BLOCK_TYPES = {G.Q8_0: WeightType.Q8_0, G.Q4_0: WeightType.Q4_0, G.Q4_1: WeightType.Q4_1}


def _weight(kind: G | torch.dtype, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The weight's stored bytes, its type code and its values as the tiles see them (bfloat16)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    if isinstance(kind, torch.dtype):
        data = torch.from_numpy(w).to(kind)
        return data, int(WeightType.F32 if kind == torch.float32 else WeightType.BF16), data.to(torch.bfloat16)
    blocks = quantize(w, kind)
    values = torch.from_numpy(dequantize(blocks, kind).reshape(n, k).astype(np.float32))
    return torch.from_numpy(blocks), int(BLOCK_TYPES[kind]), values.to(torch.bfloat16)


# rows: one, either side of a block of 64 rows and of kTileMinRows; n: whole panels of 32, a
# partial last one, fewer than one; k: one panel row of 32 values, and a longer one.
@pytest.mark.parametrize("kind", [*BLOCK_TYPES, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 31, 32, 64, 65, 130])
@pytest.mark.parametrize(("n", "k"), [(200, 96), (64, 768), (7, 32)])
def test_tile_products_equal_float64_on_the_bfloat16_operands(ops, kind, rows, n, k):
    data, code, w = _weight(kind, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    bias = torch.randn(n)
    out = ops.linear_tiles(x, data, code, n, k, bias)
    expected = x.double() @ w.double().T + bias.double()
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_weights_in_groups_of_sixteen_rows_give_the_stored_rows_results(ops, kind):
    """The step keeps Q8_0/Q4_0/Q4_1 rows in groups of sixteen where the CPU has AVX-512 VNNI
    (int8_groups.h); the tiles read such a weight a row at a time as stored: the same bits."""
    data, code, _ = _weight(kind, 80, 64)
    grouped = QuantizedWeight(data, BLOCK_TYPES[kind], (80, 64)).in_groups()
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    bias = torch.randn(80)
    assert not torch.equal(grouped.data.reshape(-1), data.reshape(-1))
    assert torch.equal(ops.linear_tiles(x, grouped.data, grouped.code, 80, 64, bias),
                       ops.linear_tiles(x, data, code, 80, 64, bias))


def test_tile_products_without_a_bias_and_refusals(ops):
    data, code, w = _weight(G.Q4_0, 40, 64)
    x = torch.randn(33, 64).to(torch.bfloat16)
    torch.testing.assert_close(ops.linear_tiles(x, data, code, 40, 64, None).double(), x.double() @ w.double().T,
                               rtol=1e-5, atol=1e-3)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.linear_tiles(x.float(), data, code, 40, 64, None)
    dense = torch.randn(40, 48).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.linear_tiles(torch.randn(33, 48).to(torch.bfloat16), dense, int(WeightType.BF16), 40, 48, None)


def test_the_op_by_op_path_takes_the_tiles_for_batches_of_32_rows_and_more(ops):
    """A stored matrix under --cpu-matrix-tiles (quantization.use_matrix_tiles) multiplies bfloat16
    batches of ops.tile_min_rows rows and more on the tiles: linear_tiles' results, rounded to
    bfloat16; smaller batches and float32 keep the other products."""
    data, code, w = _weight(G.Q4_1, 200, 96)
    qw = QuantizedWeight(data, WeightType.Q4_1, (200, 96), matrix_tiles=True)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert ops.tile_min_rows == 32
    assert torch.equal(qw.matmul(x), ops.linear_tiles(x, data, code, 200, 96, None).to(torch.bfloat16))
    assert torch.equal(qw.matmul(x[:31]), ops.linear(x[:31], data, code, 200, 96, None))
    assert torch.equal(qw.matmul(x.float()), ops.linear(x.float(), data, code, 200, 96, None))


def _mixed(name: str) -> G:
    """q and k in Q4_K, v in Q6_K (one fused projection of two formats), the rest Q4_K."""
    return G.Q6_K if ".v_proj." in name else G.Q4_K


@pytest.mark.cpu_only("the CPU's one-call step")
def test_a_mixed_projection_on_the_matrix_tiles_stays_close_to_float32(wide_llama, tmp_path):
    """--cpu-matrix-tiles on, bfloat16: a prefill of six prompts (far more than 32 rows) runs its
    products on the tiles, a fused q/k/v whose parts differ in format each writing its own columns
    of the row. Its first two tokens stay within assert_bfloat16_close's bounds of float32's."""
    path = str(tmp_path / "mixed.gguf")
    write_tiny_gguf(wide_llama, path, G.Q4_K, type_of=_mixed)
    prompts = random_prompts(6, 512, 20, 60)
    params = {**GREEDY, "max_new_tokens": 2}
    with Engine(path, dtype="bfloat16", cpu_int8_activations="off", cpu_matrix_tiles="on") as engine:
        step = engine.scheduler.runner.step
        assert step is not None and isinstance(engine.scheduler.runner.model.layers[0].self_attn.qkv_proj.weight,
                                                FusedWeight)
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        assert step.step.tile_outputs() > 0
        engine.check_memory()
    with Engine(path, dtype="float32") as engine:
        ref = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
    assert_bfloat16_close(outs, ref, 2)
