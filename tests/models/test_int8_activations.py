"""--cpu-int8-activations: products of quantized weights with their activations rounded to int8
blocks (decode steps and prefills), on the default model (SmolLM2-135M-Instruct, Q4_1 with a Q8_0 embedding),
against the float path in float32 so the rounding is the only difference; on the SIMD builds of the
kernel (AVX-512 VNNI where the CPU has it, AVX2; the build without SIMD computes the same products,
tests/layers/test_int8_products.py, at a whole model's cost of half a minute here). Float32 keeps the float path unless the
flag says on (its results stay transformers': tests/models/test_default_model.py)."""

from __future__ import annotations

import pytest
import torch

from baby_sgl import Engine
from helpers import ARCHS, GREEDY, build_for

MAX_NEW = 24
QUESTIONS = [
    "What is the capital of France?", "Give three tips to improve public speaking.",
    "Explain the concept of attention in transformer models.", "Write a haiku about autumn.",
    "Why is the sky blue?", "List two mammals that can fly or glide.",
]
# Bounds on what the rounding may move, with room over what every build showed (2-core Zen 4, one
# request at a time, 8 questions of which these are 6, 32 tokens each): the chosen tokens' logprobs
# moved by at most 0.15-0.23 before the outputs parted; 3 to 5 of the 8 outputs parted within 32
# tokens, each where the float path's two best tokens were within 0.12 of each other (a near-tie,
# which such a move flips).
LOGPROB_BOUND = 0.4
TIE_MARGIN = 0.25


def _decode(mode: str, batched: bool) -> list[dict]:
    with Engine(dtype="float32", cpu_int8_activations=mode) as engine:
        step = engine.runner.step
        assert step is not None and step.int8_activations == (mode == "on")
        prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
        params = {**GREEDY, "max_new_tokens": MAX_NEW}
        if batched:  # decode steps of 8 rows, and the prefills, take the many-row products
            outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
        else:  # decode steps of one row
            outs = [engine.generate(input_ids=p, sampling_params=params, return_logprob=True, top_logprobs_num=2)
                    for p in prompts]
        engine.check_memory()
    return [o["meta_info"] for o in outs]


@pytest.mark.cpu_only("quantized weights served by the CPU kernel")
# Batched: this CPU's build, and the AVX2 one where that is another (its many-row int8_panels.h in the step).
@pytest.mark.parametrize("arch,batched", [(a, False) for a in ARCHS if a != "x86-64"] +
                         [(a, True) for a in ("native", "x86-64-v3") if a in ARCHS])
def test_int8_activations_stay_close_to_the_float_path(arch, batched, monkeypatch):
    ops = build_for(arch, monkeypatch)
    exact, rounded = _decode("off", batched), _decode("on", batched)
    if batched and not (ops.has_int8_gemm or ops.has_int8_panels):
        # Without a many-row kernel (AVX-512 VNNI's int8_gemm.h, AVX2's int8_panels.h), products of
        # 4 rows and more stay float (int8_products.h, kInt8MaxRows): six requests decoding
        # together give the float path's bits.
        for key in ("output_token_logprobs", "output_top_logprobs"):
            assert [o[key] for o in rounded] == [o[key] for o in exact]
        return
    moved = []
    for ref, out in zip(exact, rounded):
        ref_ids = [t for _, t, _ in ref["output_token_logprobs"]]
        ids = [t for _, t, _ in out["output_token_logprobs"]]
        same = next((i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), MAX_NEW)
        for i in range(same):
            moved.append(abs(out["output_token_logprobs"][i][0] - ref["output_token_logprobs"][i][0]))
        if same < MAX_NEW:  # only a near-tie of the float path may flip
            (best, _, _), (second, _, _) = ref["output_top_logprobs"][same][:2]
            assert best - second < TIE_MARGIN, f"step {same}: a margin of {best - second:.3f} flipped"
    assert max(moved) < LOGPROB_BOUND, f"a logprob moved by {max(moved):.3f}"
    assert max(moved) > 0.0  # the activations were rounded: the float path's bits moved


def test_auto_rounds_in_bfloat16_only():
    from baby_sgl.cpu.decode_step import int8_activations

    assert int8_activations("auto", torch.bfloat16) and not int8_activations("auto", torch.float32)
    assert int8_activations("on", torch.float32) and not int8_activations("off", torch.bfloat16)
    with pytest.raises(ValueError, match="cpu_int8_activations must be one of"):
        Engine(cpu_int8_activations="yes")
