"""The default model (SmolLM2-135M-Instruct, GGUF): our loader and engine against transformers'
own GGUF loading and `generate`, under every cache setting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from baby_sgl import Engine
from baby_sgl.model_loader.loader import default_model_path
from helpers import CONFIGS, GREEDY, assert_bfloat16_close, assert_first_step_logprobs, hf_greedy

MAX_NEW = 12
QUESTIONS = [
    "What is the capital of France?", "Give three tips to improve public speaking.",
    "Explain the concept of attention in transformer models.", "Write a haiku about autumn.",
    "What is 17 times 3?", "Summarize the key benefits of unit testing in software engineering.",
    "用中文介绍一下量子计算的基本原理。", "给出三条关于上海旅游的建议。",
    "Draft a short professional email requesting a project status update.", "Name a primary color.",
    "Why is the sky blue?", "Translate 'good morning' into French.", "What does a CPU do?",
    "List two mammals that can fly or glide.", "How many days are in a leap year?", "Say hello.",
]


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    with Engine(dtype="float32") as engine:
        prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
        engine.check_memory()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    return prompts, hf_greedy(hf, prompts, MAX_NEW), hf


@pytest.mark.parametrize("config", ["radix", "no-radix", "page16", "chunked", "retract"])
def test_default_model_matches_transformers(reference, config):
    prompts, expected, _ = reference
    kwargs = dict(CONFIGS[config])
    if config == "retract":
        kwargs["max_total_tokens"] = 400
    with Engine(dtype="float32", **kwargs) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW})
        for i, out in enumerate(outs):
            assert out["output_ids"] == expected[i], f"question {i} differs under {config}"
        if config == "retract":
            assert engine.get_server_info()["num_retractions"] > 0
        engine.check_memory()


def test_default_model_first_step_logprobs(reference):
    prompts, _, hf = reference
    with Engine(dtype="float32") as engine:
        assert_first_step_logprobs(engine, hf, prompts[:4], top=5)


def test_default_model_answers_read_as_answers():
    with Engine(dtype="float32") as engine:
        out = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                          {"max_new_tokens": 20, "temperature": 0})
        assert "Paris" in out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        engine.check_memory()


def test_bfloat16_stays_close_to_float32(reference):
    """bfloat16 is not bit-exact: this states how close it stays to the float32 reference on
    the first generated token (the one every later token depends on), computed by the prefill,
    and on the second, computed by a decode step of all 16 requests (bfloat16 products): its
    logprobs within BF16_MAX_LOGPROB_DIFF, and a different token only where float32's own top
    two are that close (a near-tie)."""
    prompts, expected, _ = reference
    params = {**GREEDY, "max_new_tokens": 2}
    with Engine(dtype="bfloat16", cpu_int8_activations="off") as engine:  # int8: tests/models/test_int8_activations.py
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        engine.check_memory()
    with Engine(dtype="float32") as engine:
        ref = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
    assert_bfloat16_close(outs, ref, 2)  # the prefill's token, then the decode step's


def test_bfloat16_products_on_the_matrix_tiles_stay_close_to_float32(reference):
    """--cpu-matrix-tiles on: the prefill's products (16 prompts' rows in one pass, far more than
    32) run on the matrix tiles (tile_products.h: AMX, or torch's bfloat16 GEMM on the same panels
    where the CPU has none), the decode step's 16 rows on the other products. The first two tokens
    stay within assert_bfloat16_close's bounds of float32's."""
    prompts, _, _ = reference
    params = {**GREEDY, "max_new_tokens": 2}
    with Engine(dtype="bfloat16", cpu_int8_activations="off", cpu_matrix_tiles="on") as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        step = engine.runner.step
        assert step is not None and step.step.tile_outputs() > 0
        engine.check_memory()
    with Engine(dtype="float32") as engine:
        ref = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
    assert_bfloat16_close(outs, ref, 2)


def test_bfloat16_rows_behind_a_shared_prefix_stay_close_to_float32():
    """Decode rows whose requests share a cached prefix read it once for all of them
    (cpu_step.cpp: attend_shared, in bfloat16 dot products on CPUs with AVX512_BF16), and a
    prefill's rows attend side by side (attend_lanes): their tokens stay within
    assert_bfloat16_close's bounds of float32's."""
    notes = (Path(__file__).parent.parent / "data" / "perplexity_text.md").read_text()[:1200]
    prompts = [f"{notes}\n\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
    params = {**GREEDY, "max_new_tokens": 2}
    with Engine(dtype="bfloat16", cpu_int8_activations="off") as engine:
        engine.generate(notes, sampling_params={"max_new_tokens": 1})  # the shared text, cached
        outs = engine.generate(prompts, sampling_params=params, return_logprob=True)
        if engine.runner.step is not None:
            assert engine.runner.step.step.shared_prefix_rows() > 0
        engine.check_memory()
    with Engine(dtype="float32") as engine:
        ref = engine.generate(prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
    assert_bfloat16_close(outs, ref, 2)  # the prefill's token, then the decode step's
