"""Q8_0, Q4_0, Q4_1 and Q4_K weights stored in groups of sixteen rows (cpu/csrc/int8_groups.h), the
layout the int8 products read on CPUs with AVX-512 VNNI: the same bytes rearranged, the same
values, and products with the bits of the ungrouped weight's (int8_gemm.h's sums), whatever the
number of rows; builds without VNNI refuse them with a clear error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as G
from gguf.quants import quantize

from baby_sgl import Engine
from baby_sgl.layers import quantization
from baby_sgl.layers.quantization import QuantizedWeight, WeightType, dequantize_blocks
from gguf_writer import write_tiny_gguf
from helpers import GREEDY, build_for, random_prompts
from test_kquant_kernels import _encoded

TYPES = [WeightType.Q8_0, WeightType.Q4_0, WeightType.Q4_1, WeightType.Q4_K]
N = 80  # five groups: the kernel's pairs of groups and a single one


def _k(qtype: WeightType) -> int:
    return 768 if qtype == WeightType.Q4_K else 288  # three super-blocks, nine blocks


def _weight(qtype: WeightType, k: int, n: int = N) -> QuantizedWeight:
    if qtype == WeightType.Q4_K:  # the gguf package has no K-quant encoder
        qw = _encoded(qtype, n=n, k=k, seed=k + n)
        return QuantizedWeight(qw.data, qtype, (n, k), int8_activations=True)
    w = np.random.default_rng(k + n).standard_normal((n, k)).astype(np.float32)
    return QuantizedWeight(torch.from_numpy(quantize(w, G[qtype.name])), qtype, (n, k), int8_activations=True)


@pytest.mark.parametrize("qtype", TYPES)
def test_groups_hold_the_same_bytes_and_values(qtype):
    k = _k(qtype)
    qw = _weight(qtype, k)
    grouped = qw.in_groups()
    assert grouped.grouped and grouped.data.shape == (N // 16, 16 * qw.data.shape[1]) and grouped.nbytes == qw.nbytes
    assert not torch.equal(grouped.data.reshape(qw.data.shape), qw.data)  # rearranged, not a copy
    assert torch.equal(grouped.ungrouped().data, qw.data)
    assert torch.equal(grouped.dequantize(), dequantize_blocks(qw.data, qw.qtype, k))
    rows = torch.tensor([3, 70, 16])
    assert torch.equal(grouped.dequantize(torch.float32, rows), qw.dequantize(torch.float32, rows))
    assert torch.equal(grouped.select_rows(slice(16, 48)).data, qw.data[16:48])
    fused = QuantizedWeight.cat([grouped, qw])  # fused parts: rows as stored
    assert not fused.grouped and torch.equal(fused.data, torch.cat([qw.data, qw.data]))


def test_only_whole_groups_of_the_grouped_formats_are_grouped():
    assert not _weight(WeightType.Q4_0, 64, n=40).can_group()
    assert not QuantizedWeight(torch.zeros(32, 210, dtype=torch.uint8), WeightType.Q6_K, (32, 256)).can_group()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_products_have_the_ungrouped_weights_bits(ops, qtype, dtype):
    k = _k(qtype)
    qw = _weight(qtype, k)
    grouped = qw.in_groups()
    bias = torch.randn(N)
    if not ops.has_int8_gemm:
        with pytest.raises(RuntimeError, match="groups of sixteen rows"):
            ops.linear_int8(torch.randn(1, k), grouped.data, grouped.code, N, k, bias, True)
        return
    # One row (four groups at a time), tiles of 4, 2 and 1 rows, and rows past a tile.
    for rows in (1, 2, 3, 4, 5, 11, 33):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        x[-1, -32:] *= 1e3
        expected = ops.linear_int8(x, qw.data, int(qw.qtype), N, k, bias, True)
        assert torch.equal(ops.linear_int8(x, grouped.data, grouped.code, N, k, bias, True), expected)
        assert torch.equal(ops.linear_int8(x, grouped.data, grouped.code, N, k, bias, False), expected)


@pytest.mark.parametrize("qtype", TYPES)
def test_grouped_rows_are_looked_up_and_refused_by_float_products(ops, qtype):
    k = _k(qtype)
    qw = _weight(qtype, k)
    grouped = qw.in_groups()
    rows = torch.tensor([0, 17, 79, 17])
    for dtype in (torch.float32, torch.bfloat16):
        expected = ops.dequantize(qw.data, int(qw.qtype), N, k, rows, dtype)
        assert torch.equal(ops.dequantize(grouped.data, grouped.code, N, k, rows, dtype), expected)
    with pytest.raises(RuntimeError, match="groups of sixteen rows"):
        ops.linear(torch.randn(2, k), grouped.data, grouped.code, N, k, None)


# The output head its own or tied to the embeddings; Q4_0 with a Q4_1 embedding, Q4_K throughout.
@pytest.fixture(scope="module", params=[("wide_llama", G.Q4_0), ("wide_qwen2", G.Q4_0), ("wide_llama", G.Q4_K)],
                ids=["llama-q4_0", "qwen2-q4_0", "llama-q4_k"])
def grouped_model(request, tmp_path_factory) -> str:
    model, qtype = request.param
    path = str(tmp_path_factory.mktemp("grouped") / f"{qtype.name}.gguf")
    write_tiny_gguf(request.getfixturevalue(model), path, qtype, embed_qtype=G.Q4_1 if qtype == G.Q4_0 else qtype)
    return path


def _outputs(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 12}, return_logprob=True)
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


@pytest.mark.cpu_only("the decode step's int8 products are the CPU kernel's")
def test_an_engine_groups_its_weights_and_keeps_their_bits(grouped_model, monkeypatch):
    """With int8 activations on a VNNI build every Q4_0, Q4_1 and Q4_K matrix is grouped, the token
    embeddings too (a tied output head stays the same matrix); in the deterministic mode the
    outputs are the bits of the same engine with its weights as the file stores them, alone and
    batched."""
    ops = build_for("native", monkeypatch)
    prompts = random_prompts(4, 512, 8, 40)
    kw = dict(dtype="bfloat16", cpu_int8_activations="on", enable_deterministic_inference=True, debug_memory_check=True)
    with Engine(grouped_model, **kw) as engine:
        model = engine.runner.model
        weights = [model.embed_tokens.weight, model.lm_head.weight, model.layers[0].self_attn.qkv_proj.weight,
                   model.layers[1].mlp.down_proj.weight]
        assert all(w.grouped == ops.has_int8_gemm for w in weights)
        assert (model.lm_head.weight is model.embed_tokens.weight) == model.config.tie_word_embeddings
        grouped = [_outputs(engine, [p])[0] for p in prompts], _outputs(engine, prompts)
        engine.check_memory()
    if not ops.has_int8_gemm:
        return
    monkeypatch.setattr(quantization, "group_for_int8_products", lambda *a: None)
    with Engine(grouped_model, **kw) as engine:
        assert not engine.runner.model.lm_head.weight.grouped
        assert grouped == ([_outputs(engine, [p])[0] for p in prompts], _outputs(engine, prompts))
        engine.check_memory()
