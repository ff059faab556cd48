"""Prompt logprobs as SGLang returns them (logprob_start_len, input_token_logprobs with a null
first entry, input_top_logprobs, token_ids_logprob, return_text_in_logprobs), equal to
transformers' under every setting, also when the prompt is already in the prefix cache."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from baby_sgl import Engine
from helpers import CONFIGS, GREEDY, random_prompts, shared_prefix_prompts

SETTINGS = ["radix", "no-radix", "page16", "chunked", "mixed-chunk"]


@pytest.fixture(scope="module")
def case(tiny_llama):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompts = random_prompts(4, 512, 20, 70, seed=3) + shared_prefix_prompts(3, 512, 40, seed=4)
    with torch.no_grad():
        refs = [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]
    return tiny_llama, prompts, refs


def _check_against(ref: torch.Tensor, prompt: list[int], start: int, meta: dict, top: int) -> None:
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(prompt) - start
    assert entries[0][0] is None and entries[0][1] == prompt[start]
    for j, (lp, tok, text) in enumerate(entries[1:], start=start + 1):
        assert tok == prompt[j] and text is None
        assert abs(lp - ref[j - 1, tok].item()) < 1e-4, f"position {j}"
    if top:
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(entries) and tops[0] is None
        for j, row in enumerate(tops[1:], start=start + 1):
            want = ref[j - 1].topk(top)
            assert [t for _, t, _ in row] == want.indices.tolist()
            assert max(abs(v - w) for (v, _, _), w in zip(row, want.values.tolist())) < 1e-4


@pytest.mark.parametrize("setting", SETTINGS)
def test_prompt_logprobs_match_transformers(case, setting):
    path, prompts, refs = case
    starts = [0, 5, 17, 1, 0, 39, 41]
    with Engine(path, dtype="float32", **CONFIGS[setting]) as engine:
        # A first round puts every prompt in the cache; the second must still score the positions
        # it asks for (the cache serves at most logprob_start_len tokens of such a request).
        for round_ in range(2):
            for p, ref, s in zip(prompts, refs, starts):
                out = engine.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 2},
                                      return_logprob=True, logprob_start_len=s, top_logprobs_num=3)
                _check_against(ref, p, s, out["meta_info"], top=3)
                assert len(out["meta_info"]["output_token_logprobs"]) == 2
                if round_ and s > 0 and not CONFIGS[setting].get("disable_radix_cache"):
                    page = CONFIGS[setting].get("page_size", 1)
                    assert out["meta_info"]["cached_tokens"] >= s // page * page - page
        engine.check_memory()


def test_prompt_logprobs_in_a_batch_and_prefill_only(engine):
    """SGLang's `select` shape: a batch of prompts, max_new_tokens 0, texts in the entries."""
    prompts = ["The answer is yes", "The answer is no", "The answer is maybe"]
    outs = engine.generate(prompts, {"max_new_tokens": 0, "temperature": 0}, return_logprob=True,
                           logprob_start_len=12, return_text_in_logprobs=True)
    for text, out in zip(prompts, outs):
        meta = out["meta_info"]
        assert out["text"] == "" and out["output_ids"] == [] and meta["output_token_logprobs"] == []
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        entries = meta["input_token_logprobs"]
        assert "".join(e[2] for e in entries) == text[12:]  # one byte per token here
        assert entries[0][0] is None and all(math.isfinite(e[0]) for e in entries[1:])


def test_prompt_logprob_edges(engine):
    ids = [5, 6, 7, 8]
    none = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1}, return_logprob=True)
    assert none["meta_info"]["input_token_logprobs"] == []  # -1: no prompt logprobs, as SGLang
    at_end = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                             logprob_start_len=4)
    assert at_end["meta_info"]["input_token_logprobs"] == []
    last = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                           logprob_start_len=3)
    assert last["meta_info"]["input_token_logprobs"] == [[None, 8, None]]
    with pytest.raises(ValueError, match="logprob_start_len=5 is beyond the prompt"):
        engine.generate(input_ids=ids, return_logprob=True, logprob_start_len=5)
    ignored = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1}, logprob_start_len=2)
    assert "input_token_logprobs" not in ignored["meta_info"]  # only with return_logprob, as SGLang


def test_token_ids_logprob(engine):
    ids, wanted = [9, 10, 11, 12, 13], [3, 100, 7]
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 3}, return_logprob=True,
                          logprob_start_len=0, top_logprobs_num=1, token_ids_logprob=wanted)
    meta = out["meta_info"]
    assert meta["input_token_ids_logprobs"][0] is None
    for row, top, (lp, tok, _) in zip(meta["output_token_ids_logprobs"], meta["output_top_logprobs"],
                                      meta["output_token_logprobs"]):
        assert [t for _, t, _ in row] == wanted and all(v <= top[0][0] + 1e-6 for v, _, _ in row)
        assert top[0][1] == tok and abs(top[0][0] - lp) < 1e-6  # greedy: the chosen token is the top one
    for row in meta["input_token_ids_logprobs"][1:]:
        assert [t for _, t, _ in row] == wanted
    with pytest.raises(ValueError, match="token_ids_logprob holds token ids outside the vocabulary"):
        engine.generate(input_ids=ids, token_ids_logprob=[10**6])


def test_output_logprobs_follow_temperature_and_mask(engine):
    """As SGLang: an output token's logprob is taken from the distribution it was drawn from."""
    out = engine.generate("t", {"temperature": 0, "regex": "(a|b)"}, return_logprob=True, top_logprobs_num=2)
    (lp, tok, _), = out["meta_info"]["output_token_logprobs"]
    top = out["meta_info"]["output_top_logprobs"][0]
    # Only a and b are allowed, so their two probabilities sum to one.
    assert {t for _, t, _ in top} == set(engine.tokenizer.convert_tokens_to_ids(["a", "b"]))
    assert abs(sum(math.exp(v) for v, _, _ in top) - 1) < 1e-5


@pytest.mark.parametrize("streaming", [False, True])
def test_session_turns_give_output_logprobs_only(engine, streaming):
    sid = engine.open_session(1000, streaming=streaming)
    try:
        with pytest.raises(ValueError, match="not available for session turns"):
            engine.generate(input_ids=[5, 6], session_params={"id": sid}, return_logprob=True, logprob_start_len=0)
        first = engine.generate(input_ids=list(range(20, 60)), session_params={"id": sid},
                                sampling_params={**GREEDY, "max_new_tokens": 3}, return_logprob=True)
        second = engine.generate(input_ids=[7, 8], session_params={"id": sid, "rid": first["meta_info"]["id"]},
                                 sampling_params={**GREEDY, "max_new_tokens": 3}, return_logprob=True)
        for out in (first, second):
            assert out["meta_info"]["input_token_logprobs"] == []
            assert len(out["meta_info"]["output_token_logprobs"]) == 3
        assert second["meta_info"]["cached_tokens"] > 0
    finally:
        engine.close_session(sid)
