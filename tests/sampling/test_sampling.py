"""Sampling: validation, seeded reproducibility alone and in a batch, and each filter's effect."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from baby_sgl import SamplingParams


SAMPLED = {"max_new_tokens": 16, "temperature": 0.9, "top_k": 50, "top_p": 0.95, "ignore_eos": True}


def test_seeded_output_is_the_same_alone_and_in_a_batch(engine):
    params = {**SAMPLED, "seed": 1234}
    alone = engine.generate("the seed", params)["output_ids"]
    others = [{**SAMPLED, "seed": s} for s in range(5)] + [params] + [SAMPLED] * 3
    batch = engine.generate(["x", "yy", "zzz", "w", "v", "the seed", "u", "t", "s"], others)
    assert batch[5]["output_ids"] == alone
    assert engine.generate("the seed", {**params, "seed": 99})["output_ids"] != alone


def test_unseeded_sampling_varies(engine):
    outs = engine.generate(["same"] * 4, {**SAMPLED, "temperature": 1.5, "top_k": -1, "top_p": 1.0})
    assert len({tuple(o["output_ids"]) for o in outs}) > 1


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate("k", {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    top1 = engine.generate("k", {"max_new_tokens": 12, "temperature": 1.3, "top_k": 1, "ignore_eos": True})
    assert greedy["output_ids"] == top1["output_ids"]


def test_filters_keep_tokens_inside_the_allowed_set(engine):
    params = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
    top = engine.generate("f", params, top_logprobs_num=3)["meta_info"]["output_top_logprobs"][0]
    allowed = {t for _, t, _ in top}
    outs = engine.generate(["f"] * 12, {**params, "temperature": 2.0, "top_k": 3})
    assert {o["output_ids"][0] for o in outs} <= allowed
    outs = engine.generate(["f"] * 12, {**params, "temperature": 1.0, "min_p": 1.0})
    assert {o["output_ids"][0] for o in outs} == {top[0][1]}  # min_p=1 keeps only the most likely
    outs = engine.generate(["f"] * 12, {**params, "temperature": 1.0, "top_p": 1e-6})
    assert {o["output_ids"][0] for o in outs} == {top[0][1]}


def _penalised_greedy(hf, prompt: list[int], steps: int, repetition: float = 1.0, frequency: float = 0.0,
                      presence: float = 0.0) -> list[int]:
    """transformers' float32 logits, penalised as SGLang and OpenAI define it, argmax: repetition
    divides positive logits (multiplies negative ones) of every token in the prompt or output;
    frequency subtracts per occurrence in the output, presence once per token that occurred."""
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        seen = sorted(set(prompt) | set(out))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / repetition, logits[seen] * repetition)
        if out:
            counts = torch.bincount(torch.tensor(out), minlength=logits.numel()).float()
            logits -= frequency * counts + presence * (counts > 0).float()
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.8}, {"frequency_penalty": 1.5},
                                     {"presence_penalty": 1.5}, {"frequency_penalty": -0.5, "presence_penalty": 0.7}])
def test_each_penalty_is_applied_as_defined(engine, tiny_llama, penalty):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompt, steps = [7, 7, 7, 7, 9, 7], 24
    expected = _penalised_greedy(hf, prompt, steps, penalty.get("repetition_penalty", 1.0),
                                 penalty.get("frequency_penalty", 0.0), penalty.get("presence_penalty", 0.0))
    assert expected != _penalised_greedy(hf, prompt, steps), "the penalty changes nothing here: a useless case"
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": steps, "temperature": 0,
                                                             "ignore_eos": True, **penalty})
    assert out["output_ids"] == expected


def test_min_new_tokens_blocks_stop_tokens(engine):
    first = engine.generate("m", {"max_new_tokens": 8, "temperature": 0})["output_ids"][0]
    out = engine.generate("m", {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [first],
                                "min_new_tokens": 3})
    assert out["output_ids"][0] != first and len(out["output_ids"]) >= 3


def test_logprobs_are_consistent(engine):
    out = engine.generate("lp", {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
                          return_logprob=True, top_logprobs_num=2)
    meta = out["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    for (lp, tok, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert lp <= 0 and top[0][1] == tok and top[0][0] == pytest.approx(lp)


@pytest.mark.parametrize("field, value", [
    ("min_p", 1.5), ("frequency_penalty", 3), ("presence_penalty", -3), ("repetition_penalty", 0),
    ("min_new_tokens", 500), ("stop", [""]), ("seed", "abc"), ("n", 0), ("stop_token_ids", [-1]),
])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_defaults_and_sglang_spellings():
    p = SamplingParams.from_dict({"stop": "END", "sampling_seed": 3}, defaults={"temperature": 0.6})
    assert p.stop == ["END"] and p.seed == 3 and p.temperature == 0.6


def test_sampled_tokens_follow_the_distribution(engine):
    """Temperature 1, nothing cut: 3000 one-token draws of one prompt against the engine's own
    probabilities for it (chi-square over the 8 likeliest tokens and the rest, 8 degrees of
    freedom: 26.1 is the 0.1% critical value)."""
    prompt = [7, 8, 9, 10]
    ref = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0},
                          top_logprobs_num=8)
    top = {tok: math.exp(lp) for lp, tok, _ in ref["meta_info"]["output_top_logprobs"][0]}
    outs = engine.generate(input_ids=[prompt] * 3000, sampling_params={"max_new_tokens": 1, "temperature": 1.0})
    counts = collections.Counter(o["output_ids"][0] for o in outs)
    expected = {**{t: 3000 * p for t, p in top.items()}, "rest": 3000 * (1 - sum(top.values()))}
    observed = {**{t: counts.get(t, 0) for t in top}, "rest": sum(n for t, n in counts.items() if t not in top)}
    chi2 = sum((observed[k] - e) ** 2 / e for k, e in expected.items() if e > 0)
    assert chi2 < 26.1, (chi2, observed, expected)
