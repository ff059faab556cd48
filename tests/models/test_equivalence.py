"""Greedy outputs equal transformers' `generate` under every cache/paging/chunking/retraction
setting (invariant 6), for tiny random checkpoints of every family built in the test (Llama,
Qwen2, Qwen3, Qwen3-MoE, Mixtral, Mistral, Phi-3, Gemma 3: conftest.FAMILIES says what each
exercises)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from baby_sgl import Engine
from baby_sgl.cpu import decode_step, toolchain
from helpers import (ARCHS, CONFIGS, GREEDY, assert_first_step_logprobs, assert_setting_exercised, build_for, hf_greedy,
                     random_prompts, shared_prefix_prompts)

MAX_NEW = 24


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_qwen3_moe", "tiny_mixtral",
                                        "tiny_mistral", "tiny_phi3", "tiny_gemma3"])
def case(request):
    path = request.getfixturevalue(request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(12, 512, 3, 90) + shared_prefix_prompts(6, 512, 40)
    return path, prompts, hf_greedy(hf, prompts, MAX_NEW), hf


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_transformers(case, config):
    path, prompts, expected, _ = case
    with Engine(path, dtype="float32", **CONFIGS[config]) as engine:
        params = {**GREEDY, "max_new_tokens": MAX_NEW}
        first = engine.generate(input_ids=prompts, sampling_params=params)
        # A second round is served largely from the prefix cache and must not change a token.
        second = engine.generate(input_ids=prompts, sampling_params=params)
        for i, (a, b) in enumerate(zip(first, second)):
            assert a["output_ids"] == expected[i], f"prompt {i} differs under {config}"
            assert b["output_ids"] == expected[i], f"prompt {i} differs under {config} (cached round)"
        assert_setting_exercised(engine, config, prompts, first, second)
        if CONFIGS[config].get("enable_torch_compile"):
            assert engine.runner.compiled is not None, "compiled graphs were meant to run"
        elif engine.runner.device.type == "cpu" and toolchain.cxx_compiler() is not None:
            assert engine.runner.step is not None, "every family decodes in the one-call CPU step"
        if engine.runner.step is not None and not CONFIGS[config].get("disable_radix_cache") and \
                not any(k in config for k in ("retract", "spec", "compile")):
            # The cached round's shared-prefix prompts decode with their prefix read once for all
            # of them (cpu_step.cpp: attend_shared; failed with kMinShared above the prefix).
            assert engine.runner.step.step.shared_prefix_rows() > 0
        engine.check_memory()


@pytest.mark.cpu_only("the CPU's one-call decode step")
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "native"])
def test_every_instruction_set_gives_the_same_tokens(case, arch, monkeypatch):
    """The one-call step built for AVX2 (x86-64-v3) and for no SIMD at all (x86-64) gives every
    family's greedy ids too (experts, windows, partial rope, Gemma's norms included)."""
    path, prompts, expected, _ = case
    build_for(arch, monkeypatch)
    with Engine(path, dtype="float32", page_size=4) as engine:
        assert engine.runner.step is not None
        for _ in range(2):  # the second round from the prefix cache: rows behind a shared prefix
            outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW})
            assert [o["output_ids"] for o in outs] == expected
        assert engine.runner.step.step.shared_prefix_rows() > 0
        engine.check_memory()


def test_the_op_by_op_path_gives_the_same_tokens(case, monkeypatch):
    """Without the one-call step (a GPU, tensor parallelism, no compiler) every pass runs op by op:
    prefill chunks, mixed passes and decode there give every family's greedy ids too."""
    path, prompts, expected, _ = case
    monkeypatch.setattr(decode_step, "can_run", lambda *a: False)
    with Engine(path, dtype="float32", **CONFIGS["mixed-chunk"]) as engine:
        assert engine.runner.step is None
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW})
        assert [o["output_ids"] for o in outs] == expected
        assert engine.get_server_info()["mixed_steps"] > 0
        engine.check_memory()


@pytest.mark.cpu_only("the CPU's one-call decode step")
@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_gemma3"])
def test_long_decode_rows_attend_in_pieces(kind, request):
    """Decode rows over more than 256 keys attend in pieces merged by their log-sum-exps
    (cpu_step.cpp: plan_pieces), alone or batched, beside Gemma's windowed layers too, and give
    transformers' greedy ids, and each decoded token's logprob within 1e-4 of transformers' (a
    merge 0.1% off kept the ids and moved the logprobs by ~2e-3)."""
    path = request.getfixturevalue(kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(3, 512, 250, 700, seed=7)
    expected = hf_greedy(hf, prompts, 16)
    with Engine(path, dtype="float32") as engine:
        assert engine.runner.step is not None
        params = {**GREEDY, "max_new_tokens": 16}
        alone = [engine.generate(input_ids=p, sampling_params=params, return_logprob=True) for p in prompts]
        batched = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        assert [o["output_ids"] for o in alone] == expected and batched == expected
        assert engine.runner.step.step.split_rows() > 0
        engine.check_memory()
    for p, o in zip(prompts, alone):
        ids = o["output_ids"]
        with torch.no_grad():  # position len(p) - 1 + i predicts output token i
            logits = hf(torch.tensor([p + ids])).logits[0, len(p) - 1 : len(p) - 1 + len(ids)]
        reference = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(ids)), torch.tensor(ids)]
        got = torch.tensor([lp[0] for lp in o["meta_info"]["output_token_logprobs"]])
        assert (got - reference).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def biased_wide_qwen2(wide_qwen2, tmp_path_factory) -> str:
    """The wide Qwen2 (q/k/v of 256, 128 and 128 outputs: 512 fused) with random q/k/v biases:
    transformers initialises them to zeros, which would hide where each bias is added."""
    model = AutoModelForCausalLM.from_pretrained(wide_qwen2, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.normal_(0, 1.0, generator=torch.Generator().manual_seed(len(name)))
    path = tmp_path_factory.mktemp("biased-wide-qwen2")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(wide_qwen2).save_pretrained(path)
    return str(path)


@pytest.mark.cpu_only("the CPU's one-call decode step")
def test_a_biased_projection_wider_than_a_blas_panel_gives_the_same_tokens(biased_wide_qwen2):
    """From 16 rows the one-call step's float32 products go through BLAS, 128 weight columns a
    panel, each panel's bias added after its product (blas_products.h): the fused q/k/v here is
    four panels wide (the tiny Qwen2's is one), and each must add its own columns' biases. 18
    requests decode together and give transformers' greedy ids."""
    hf = AutoModelForCausalLM.from_pretrained(biased_wide_qwen2, dtype=torch.float32).eval()
    prompts = random_prompts(18, 512, 3, 30, seed=5)
    expected = hf_greedy(hf, prompts, 8)
    with Engine(biased_wide_qwen2, dtype="float32") as engine:
        assert engine.runner.step is not None
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 8})
        assert [o["output_ids"] for o in outs] == expected
        engine.check_memory()


def test_first_step_logprobs_match_transformers(case):
    path, prompts, _, hf = case
    with Engine(path, dtype="float32") as engine:
        assert_first_step_logprobs(engine, hf, prompts[:6], top=10)


def test_compile_without_a_cxx_compiler_runs_eager(tiny_llama, monkeypatch, caplog):
    monkeypatch.setattr("baby_sgl.model_executor.model_runner.cxx_compiler", lambda: None)
    with Engine(tiny_llama, dtype="float32", enable_torch_compile=True) as engine:
        assert engine.runner.compiled is None
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 3})
        assert len(out["output_ids"]) == 3
    assert sum("no C++ compiler" in r.message for r in caplog.records) == 1
