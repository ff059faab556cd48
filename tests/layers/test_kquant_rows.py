"""The K-quants' products of one to three activation rows in the decode step's default int8 mode
(cpu/csrc/kquant_rows.h: Q4_K, Q5_K, Q6_K read in place, a super-block's eight sub-block sums
scaled together), against float64 products of the dequantized weights with the activations
rounded to Q8 blocks; on every build (AVX-512 VNNI where the CPU has it, AVX2, no SIMD). The
deterministic mode keeps int8_gemm.h's sums, a row's bits the same in any batch."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as G

from baby_sgl import Engine
from baby_sgl.layers.quantization import WeightType
from gguf_writer import write_tiny_gguf
from helpers import build_for, random_prompts
from test_int8_products import _activations, q8_dequantized
from test_kquant_kernels import _encoded, _random_blocks, _reference

K_QUANTS = [WeightType.Q4_K, WeightType.Q5_K, WeightType.Q6_K]
N = 67  # an odd share of outputs per thread


@pytest.mark.parametrize("qtype", K_QUANTS)
@pytest.mark.parametrize("make", [_random_blocks, _encoded])
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("k", [256, 768, 4096])  # one super-block, three, sixteen
def test_few_rows_equal_float64_on_the_rounded_activations(ops, qtype, make, rows, k):
    qw = make(qtype, n=N, k=k, seed=rows)
    ref = _reference(qw.data.numpy(), qtype, N, k).double()
    x = _activations(rows, k)
    bias = torch.randn(N)
    out = ops.linear_int8(x, qw.data, int(qtype), N, k, bias, same_bits_for_any_rows=False)
    expected = q8_dequantized(x) @ ref.T + bias.double()
    # float32 scales and sums over at most 128 blocks: a few ulps of the largest partial sum.
    scale = (q8_dequantized(x).abs() @ ref.abs().T).max()
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=4e-6 * scale.item())


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_bfloat16_activations_are_rounded_from_their_own_values(ops, qtype):
    qw = _random_blocks(qtype, n=N, k=512, seed=2)
    x = _activations(2, 512).bfloat16()
    out = ops.linear_int8(x, qw.data, int(qtype), N, 512, None, same_bits_for_any_rows=False)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ops.linear_int8(x.float(), qw.data, int(qtype), N, 512, None,
                                            same_bits_for_any_rows=False).bfloat16())


def _q4_k_m(name: str) -> G:
    """llama.cpp's Q4_K_M mix: Q4_K, with v and down in Q6_K (and Q5_K for layer 1's gate)."""
    if ".v_proj." in name or ".down_proj." in name or "lm_head" in name:
        return G.Q6_K
    return G.Q5_K if ".layers.1.mlp.gate_proj" in name else G.Q4_K


@pytest.fixture(scope="module")
def q4_k_m_llama(wide_llama, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("kquant-rows") / "q4_k_m.gguf")
    write_tiny_gguf(wide_llama, path, G.Q4_K, type_of=_q4_k_m)
    return path


PROMPTS = random_prompts(3, 512, 8, 40)
OTHERS = random_prompts(5, 512, 1, 60, seed=1)
PARAMS = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def _run(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(input_ids=prompts, sampling_params=PARAMS, return_logprob=True)
    return [(o["output_ids"], [lp[0] for lp in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def _alone(engine: Engine) -> list[tuple[list[int], list[float]]]:
    return [_run(engine, [p])[0] for p in PROMPTS]


def _engine(path: str, deterministic: bool) -> Engine:
    return Engine(path, dtype="float32", cpu_int8_activations="on", enable_deterministic_inference=deterministic,
                  debug_memory_check=True)


@pytest.mark.cpu_only("the decode step's int8 products are the CPU kernel's")
def test_the_decode_step_takes_the_few_row_products_in_the_default_mode_only(q4_k_m_llama, monkeypatch):
    """Deterministic mode: a request's bits are the same alone as among others (cpu_step.cpp:
    linear, were takes_kquant_rows asked without deterministic_, one to three rows would take the
    few-row sums and four and more the gemm's). Default mode, where the CPU has AVX-512 VNNI (and
    both modes round every product's activations): a request alone decodes one row at a time, its
    Q6_K and Q5_K matrices through kquant_rows.h (the Q4_K ones are grouped and take the gemm's
    sums in both modes, int8_groups.h), whose sums round otherwise than int8_gemm.h's: the same
    tokens up to a near tie, close logprobs, not the same bits."""
    ops = build_for("native", monkeypatch)  # the engine's build, whatever the `ops` tests above left
    with _engine(q4_k_m_llama, deterministic=True) as engine:
        gemm = _alone(engine)
        assert _run(engine, PROMPTS + OTHERS)[: len(PROMPTS)] == gemm
        engine.check_memory()
    if not ops.has_int8_gemm:
        return
    with _engine(q4_k_m_llama, deterministic=False) as engine:
        few_rows = _alone(engine)
        engine.check_memory()
    for (ids_a, a), (ids_b, b) in zip(few_rows, gemm):
        # Float32 rounding (the sums here, the step's attention by lanes) moves an activation
        # across an int8 rounding boundary now and then: logprobs moved by up to 0.024 (2-core
        # Zen 4), and the random tiny model's flat logits can then tie: the tokens agree up to a
        # first difference, where each run's token is as likely as the other's (a near tie).
        same = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), len(ids_b))
        assert same >= 1, "the prefill's token must agree"
        upto = min(same + 1, len(ids_b))
        torch.testing.assert_close(torch.tensor(a[:upto]), torch.tensor(b[:upto]), rtol=0, atol=0.1)
    assert few_rows != gemm
