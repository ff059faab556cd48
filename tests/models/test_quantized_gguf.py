"""Quantized GGUF checkpoints served as they are: greedy outputs equal transformers' on the same
weights dequantized (float32), under every cache/paging/chunking/retraction setting, for tiny
random Llama (Q4_1, Q8_0 embedding) and Qwen2 (Q4_0 with a tied Q8_0 embedding) files written
with the gguf package; and the paths that dequantize instead."""

from __future__ import annotations

import logging

import pytest
import torch
from gguf import GGMLQuantizationType as G
from transformers import AutoModelForCausalLM

from baby_sgl import Engine
from baby_sgl.layers.quantization import QuantizedWeight
from gguf_writer import write_tiny_gguf
from helpers import ARCHS, CONFIGS, GREEDY, assert_first_step_logprobs, build_for, hf_greedy, random_prompts, shared_prefix_prompts

MAX_NEW = 24
KINDS = {"tiny_llama": G.Q4_1, "tiny_qwen2": G.Q4_0}


@pytest.fixture(scope="module", params=list(KINDS))
def case(request, tmp_path_factory):
    hf_dir = request.getfixturevalue(request.param)
    path = str(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf")
    weights = write_tiny_gguf(hf_dir, path, KINDS[request.param])
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf.load_state_dict(weights, strict=False)  # the values the blocks stand for
    hf.tie_weights()
    prompts = random_prompts(10, 512, 3, 90) + shared_prefix_prompts(6, 512, 40)
    return path, prompts, hf_greedy(hf, prompts, MAX_NEW), hf


# Quantized matrices are multiplied as stored by the CPU kernel only (elsewhere they are dequantized).
kernel_only = pytest.mark.cpu_only("quantized weights served by the CPU kernel")


def _served_quantized(engine: Engine) -> bool:
    model = engine.runner.model
    return all(isinstance(m.weight, QuantizedWeight) for m in
               [model.embed_tokens, model.lm_head, *(l.mlp.down_proj for l in model.layers)])


@kernel_only
@pytest.mark.parametrize("config", list(CONFIGS))
def test_quantized_greedy_matches_transformers(case, config):
    path, prompts, expected, _ = case
    with Engine(path, dtype="float32", **CONFIGS[config]) as engine:
        # Compiled graphs take dense weights: with --enable-torch-compile the file is dequantized.
        compiled = CONFIGS[config].get("enable_torch_compile", False)
        assert _served_quantized(engine) != compiled
        assert (engine.runner.step is not None) != compiled
        params = {**GREEDY, "max_new_tokens": MAX_NEW}
        for round_ in ("first", "cached"):
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            for i, out in enumerate(outs):
                assert out["output_ids"] == expected[i], f"prompt {i} differs under {config} ({round_} round)"
        engine.check_memory()


@kernel_only
def test_quantized_first_step_logprobs_match_transformers(case):
    path, prompts, _, hf = case
    with Engine(path, dtype="float32") as engine:
        assert _served_quantized(engine)
        assert_first_step_logprobs(engine, hf, prompts[:6], top=10)


def test_quantization_none_dequantizes_at_load(case):
    path, prompts, expected, _ = case
    with Engine(path, dtype="float32", quantization="none") as engine:
        assert not any(isinstance(m.weight, QuantizedWeight) for m in engine.runner.model.modules()
                       if hasattr(m, "weight"))
        outs = engine.generate(input_ids=prompts[:8], sampling_params={**GREEDY, "max_new_tokens": MAX_NEW})
        assert [o["output_ids"] for o in outs] == expected[:8]
        engine.check_memory()


@kernel_only
def test_without_a_compiler_the_file_is_dequantized(case, monkeypatch, caplog):
    from baby_sgl.cpu import ops as cpu_ops

    path, prompts, expected, _ = case
    monkeypatch.setattr("baby_sgl.cpu.toolchain.cxx_compiler", lambda: None)
    monkeypatch.setattr(cpu_ops, "_loaded", {})
    with caplog.at_level(logging.WARNING):
        with Engine(path, dtype="float32") as engine:
            assert not _served_quantized(engine) and engine.runner.step is None
            outs = engine.generate(input_ids=prompts[:8], sampling_params={**GREEDY, "max_new_tokens": MAX_NEW})
            assert [o["output_ids"] for o in outs] == expected[:8]
            engine.check_memory()
    assert any("dequantized at load" in r.message for r in caplog.records)


def test_quantization_flag_is_checked(tiny_llama, case):
    path = case[0]
    with pytest.raises(ValueError, match="quantization must be one of"):
        Engine(path, quantization="int4")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        Engine(tiny_llama, quantization="gguf")
    with pytest.raises(ValueError, match="--quantization none"):
        Engine(path, quantization="gguf", enable_torch_compile=True)


@kernel_only
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "native"])
def test_every_instruction_set_gives_the_same_tokens(case, arch, monkeypatch):
    """The step and the kernels built for AVX2 (x86-64-v3) and for no SIMD at all (x86-64) give
    transformers' greedy ids too, with the file served quantized."""
    path, prompts, expected, _ = case
    build_for(arch, monkeypatch)
    with Engine(path, dtype="float32", page_size=4) as engine:
        assert _served_quantized(engine) and engine.runner.step is not None
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW})
        assert [o["output_ids"] for o in outs] == expected
        engine.check_memory()
