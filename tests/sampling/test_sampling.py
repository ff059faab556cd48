"""Sampling: validation, seeded reproducibility alone and in a batch, and each filter's effect."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from baby_sgl.core.req import PenaltyCounts
from baby_sgl import SamplingParams


ONE = {"max_new_tokens": 1, "ignore_eos": True}
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
                      presence: float = 0.0, *, wrong: str | None = None) -> list[int]:
    """transformers' float32 logits, penalised as SGLang and OpenAI define it, argmax: repetition
    divides positive logits (multiplies negative ones) of every token in the prompt or output;
    frequency subtracts per occurrence in the output, presence once per token that occurred.
    wrong: a mistaken variant a test must tell apart ("twice": every penalty applied twice;
    "presence as frequency": presence subtracted per occurrence; "prompt spared": repetition
    leaving the prompt's tokens alone)."""
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        for _ in range(2 if wrong == "twice" else 1):
            seen = sorted((set() if wrong == "prompt spared" else set(prompt)) | set(out))
            logits[seen] = torch.where(logits[seen] > 0, logits[seen] / repetition, logits[seen] * repetition)
            if out:
                counts = torch.bincount(torch.tensor(out), minlength=logits.numel()).float()
                present = counts if wrong == "presence as frequency" else (counts > 0).float()
                logits -= frequency * counts + presence * present
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


def _top(engine, prompt, k):
    out = engine.generate(prompt, {**ONE, "temperature": 0}, top_logprobs_num=k)
    return out["meta_info"]["output_top_logprobs"][0]


def test_top_k_keeps_exactly_its_tokens_in_a_mixed_batch(engine):
    """top_k 3 rows alternating with top_k 50 rows (so every pass's widest cut is 50): 200 draws
    at temperature 1 reach each of the 3 likeliest tokens and no other."""
    (_, t0, _), (_, t1, _), (_, t2, _) = _top(engine, "f", 3)
    params = [{**ONE, "temperature": 1.0, "top_k": 3}, {**ONE, "temperature": 1.0, "top_k": 50}] * 200
    outs = engine.generate(["f"] * 400, params)
    assert {o["output_ids"][0] for o in outs[0::2]} == {t0, t1, t2}


def test_top_p_keeps_the_smallest_set_reaching_it(engine):
    """top_p halfway into the second likeliest token's mass keeps exactly the two likeliest."""
    (l0, t0, _), (l1, t1, _) = _top(engine, "f", 2)
    top_p = math.exp(l0) + math.exp(l1) / 2
    outs = engine.generate(["f"] * 200, {**ONE, "temperature": 1.0, "top_p": top_p})
    assert {o["output_ids"][0] for o in outs} == {t0, t1}


def test_a_seeded_request_draws_afresh_at_each_step(engine):
    """Near-uniform (temperature 1e4): a seed's 16 draws are mostly distinct tokens; one number
    reused at every step would pick about the same token each time."""
    out = engine.generate("s", {"max_new_tokens": 16, "temperature": 1e4, "seed": 5, "ignore_eos": True})
    assert len(set(out["output_ids"])) > 8, out["output_ids"]


def test_sampled_logprobs_come_after_the_temperature(engine):
    """As SGLang: log_softmax(logits / T); the gaps between top entries are the greedy ones / T."""
    kw = dict(return_logprob=True, top_logprobs_num=3)
    cold = engine.generate("t", {**ONE, "temperature": 0}, **kw)["meta_info"]
    hot = engine.generate("t", {**ONE, "temperature": 2.0, "seed": 1}, **kw)["meta_info"]
    g, h = cold["output_top_logprobs"][0], hot["output_top_logprobs"][0]
    assert [t for _, t, _ in g] == [t for _, t, _ in h]
    for i in (1, 2):
        assert h[0][0] - h[i][0] == pytest.approx((g[0][0] - g[i][0]) / 2.0, rel=1e-4)
    lp, tok, _ = hot["output_token_logprobs"][0]
    for v, t, _ in h:
        if t == tok:
            assert lp == pytest.approx(v, abs=1e-6)


BASE = [7, 7, 7, 7, 9, 7]
LONG = BASE + [509, 330, 102, 27, 509, 330]  # the base prompt's first six greedy tokens appended


@pytest.mark.parametrize("prompt, penalty", [
    (LONG, {"repetition_penalty": 1.3}), (BASE, {"frequency_penalty": 0.3}), (BASE, {"presence_penalty": -1.0}),
    (BASE, {"frequency_penalty": -0.5, "presence_penalty": 0.3}),
])
def test_each_penalty_once_as_defined(engine, tiny_llama, prompt, penalty):
    """Each penalty gives the greedy ids of its definition, on prompts where the mistaken variants
    (applied twice, presence as frequency, the prompt spared) give other ids."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    args = (penalty.get("repetition_penalty", 1.0), penalty.get("frequency_penalty", 0.0),
            penalty.get("presence_penalty", 0.0))
    expected = _penalised_greedy(hf, prompt, 24, *args)
    assert expected != _penalised_greedy(hf, prompt, 24), "the penalty changes nothing here"
    assert expected != _penalised_greedy(hf, prompt, 24, *args, wrong="twice"), "applied twice would pass"
    if args[2]:
        assert expected != _penalised_greedy(hf, prompt, 24, *args, wrong="presence as frequency"), \
            "presence as frequency would pass"
    if args[0] != 1.0:
        assert expected != _penalised_greedy(hf, prompt, 24, *args, wrong="prompt spared"), \
            "sparing the prompt would pass"
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 24, "temperature": 0,
                                                             "ignore_eos": True, **penalty})
    assert out["output_ids"] == expected


def test_logprobs_include_the_logit_bias(engine):
    """As SGLang and the module's docstring: the distribution after penalties and logit_bias.
    A bias of 100 makes token 17 certain: its logprob is ~0 and it heads the top list."""
    out = engine.generate("b", {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True,
                                "logit_bias": {"17": 100.0}}, return_logprob=True, top_logprobs_num=1)
    meta = out["meta_info"]
    for (lp, tok, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert tok == 17 and lp > -1e-3 and top[0][1] == 17


def test_greedy_rows_skip_nan_and_take_the_first_largest():
    """A greedy row's token is its largest logit, the first on a tie, a NaN never chosen (a NaN-aware
    argmax of the raw logits would pick it), +inf above any finite value, with or without logprobs."""
    from baby_sgl.sampling.sampler import Sampler
    from baby_sgl.sampling.sampling_batch import LogprobQuery, SamplingBatch

    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, -1.0, 0.0],
                           [nan, 1.0, 3.0, nan, 3.0, -inf],
                           [1.0, inf, 2.0, inf, nan, 0.0],
                           [-inf, -inf, -inf, -inf, -7.0, -inf]], device="cpu")
    greedy = SamplingParams(temperature=0.0)
    rows = len(logits)

    def batch(logprobs):
        return SamplingBatch([greedy] * rows, [0] * rows, [None] * rows, [None] * rows, [logprobs] * rows)

    sampler = Sampler(vocab_size=6, eos_token_ids=[0], random_seed=0)
    for dtype in (torch.float32, torch.bfloat16):  # numpy's argmax, and torch's
        assert sampler.sample(logits.to(dtype), batch(None)).tokens == [1, 2, 1, 4]
        assert sampler.sample(logits.to(dtype), batch(LogprobQuery(0, None))).tokens == [1, 2, 1, 4]


def test_penalty_counts_follow_the_output_a_step_at_a_time():
    """A penalised request's counts were rebuilt from its whole sequence at every step (a set of
    the prompt and output, a list copy, a bincount: ~1.6 ms a request-step at 8k tokens). Now they
    are kept with the request and each step adds only its new tokens, to the same tensors."""
    prompt, output, vocab = [5, 9, 9, 700], [], 512  # 700: past the logits' width, never counted
    state = PenaltyCounts()
    counts, seen = state.update(prompt, output, vocab, torch.device("cpu"))
    assert not counts.any() and seen.nonzero().flatten().tolist() == [5, 9]
    cpu = torch.device("cpu")
    g = torch.Generator(device=cpu).manual_seed(0)
    for step in range(50):
        output += torch.randint(0, vocab, (1 + step % 3,), generator=g, device=cpu).tolist()  # speculation adds several
        again, seen_again = state.update(prompt, output, vocab, cpu)
        assert again is counts and seen_again is seen and state.synced == len(output)
        assert torch.equal(counts.long(), torch.bincount(torch.tensor(output, device=cpu), minlength=vocab))
        assert seen.nonzero().flatten().tolist() == sorted({5, 9} | set(output))
