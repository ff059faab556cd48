"""Speculative decoding (--speculative-algorithm NGRAM) through the public API: outputs equal plain
decoding's (greedy, seeded sampling, stops and lengths inside an accepted run, constraints,
logprobs, streams, sessions), sampled outputs keep their distribution, and the drafts come from
where they should. The tiny random model rarely repeats its prompt, so drafts are made to exist
the way a server sees them most: a request whose text another request already produced (its
prompt and output joined the prefix cache's text). Every engine checks the memory invariant
after each step (debug_memory_check) and at the end of each test."""

from __future__ import annotations

import collections
import math

import pytest

from baby_sgl import Engine
from baby_sgl.speculative.ngram import MIN_DRAFTED, PAUSE_STEPS, RECENT_VERIFIES, NgramDrafter, RequestDrafts
from helpers import GREEDY, random_prompts

PROMPTS = random_prompts(4, 512, 20, 40, seed=11)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    with Engine(tiny_llama, dtype="float32", max_running_requests=8) as engine:
        yield engine


@pytest.fixture(scope="module")
def spec(tiny_llama):
    with Engine(tiny_llama, dtype="float32", max_running_requests=8, speculative_algorithm="NGRAM",
                debug_memory_check=True) as engine:
        yield engine


@pytest.fixture
def primed(spec):
    """The spec engine after each prompt was answered once (greedy, 32 tokens): a second request
    drafts that answer from the cache's text."""
    spec.generate(input_ids=PROMPTS, sampling_params={**GREEDY, "max_new_tokens": 32})
    yield spec
    spec.check_memory()


def _verified(outs: list[dict]) -> int:
    return sum(o["meta_info"]["spec_accepted_tokens"] for o in outs)


@pytest.mark.parametrize("params", [
    {"max_new_tokens": 32},
    {"max_new_tokens": 11},  # ends inside an accepted run
    {"max_new_tokens": 32, "min_new_tokens": 5},
    {"max_new_tokens": 32, "repetition_penalty": 1.3, "frequency_penalty": 0.4},
    {"max_new_tokens": 32, "logit_bias": {"17": 2.0}},
])
def test_greedy_output_is_plain_decodings(plain, primed, params):
    params = {**GREEDY, **params}
    want = plain.generate(input_ids=PROMPTS, sampling_params=params)
    got = primed.generate(input_ids=PROMPTS, sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [o["meta_info"]["finish_reason"] for o in got] == [o["meta_info"]["finish_reason"] for o in want]
    if "repetition_penalty" not in params and "logit_bias" not in params:  # else the answers differ from the cache's
        assert _verified(got) > 0, "the cached answers were meant to be drafted and accepted"


def test_stop_ids_and_strings_inside_an_accepted_run(plain, primed):
    answer = plain.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 32})
    ids, text = answer["output_ids"], answer["text"]
    for params in ({"stop_token_ids": [ids[9]]}, {"stop": [text[len(text) // 2 : len(text) // 2 + 3]]},
                   {"stop": [text[len(text) // 2 : len(text) // 2 + 3]], "no_stop_trim": True}):
        params = {**GREEDY, "max_new_tokens": 32, **params}
        want = plain.generate(input_ids=PROMPTS[0], sampling_params=params)
        got = primed.generate(input_ids=PROMPTS[0], sampling_params=params)
        assert (got["output_ids"], got["text"], got["meta_info"]["finish_reason"]) == \
            (want["output_ids"], want["text"], want["meta_info"]["finish_reason"]), params
        assert got["meta_info"]["spec_accepted_tokens"] > 0
        assert len(got["output_ids"]) < 32


def test_logprobs_of_accepted_tokens_are_plain_decodings(plain, primed):
    kw = dict(return_logprob=True, top_logprobs_num=3)
    params = {**GREEDY, "max_new_tokens": 24}
    want = plain.generate(input_ids=PROMPTS, sampling_params=params, **kw)
    got = primed.generate(input_ids=PROMPTS, sampling_params=params, **kw)
    assert _verified(got) > 0
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"]
        for (lg, tg, _), (lw, tw, _) in zip(g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"]):
            assert tg == tw and abs(lg - lw) < 1e-4
        for tops_g, tops_w in zip(g["meta_info"]["output_top_logprobs"], w["meta_info"]["output_top_logprobs"]):
            assert [t for _, t, _ in tops_g] == [t for _, t, _ in tops_w]


def test_a_constraint_rejects_the_drafts_it_refuses(plain, primed):
    """The cached answers are unconstrained, so most drafts break the regex: they are rejected,
    the matcher advances over accepted tokens only, and the output is plain decoding's."""
    params = {**GREEDY, "max_new_tokens": 24, "regex": "[a-f]{3,30}"}
    want = plain.generate(input_ids=PROMPTS, sampling_params=params)
    got = primed.generate(input_ids=PROMPTS, sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert all("error" not in o and o["meta_info"]["finish_reason"]["type"] in ("stop", "length") for o in got)


def test_seeded_sampling_draws_what_plain_decoding_draws(plain, spec):
    params = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_new_tokens": 24, "ignore_eos": True}
    want = plain.generate(input_ids=PROMPTS, sampling_params=params)
    spec.generate(input_ids=PROMPTS, sampling_params=params)  # its answers become the drafts
    got = spec.generate(input_ids=PROMPTS, sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert _verified(got) > 0
    spec.check_memory()


def test_streams_carry_several_tokens_per_event(plain, primed):
    params = {**GREEDY, "max_new_tokens": 32}
    want = plain.generate(input_ids=PROMPTS[1], sampling_params=params)
    pieces = list(primed.generate(input_ids=PROMPTS[1], sampling_params=params, stream=True))
    ids = [t for p in pieces for t in p["output_ids"]]
    assert ids == want["output_ids"] and "".join(p["text"] for p in pieces) == want["text"]
    assert max(len(p["output_ids"]) for p in pieces) > 1, "accepted drafts arrive together"


def test_session_turns(plain, spec):
    """A streaming session: the second turn repeats the first, whose answer is then drafted from
    the turn's own context."""
    outs = {}
    for name, engine in (("plain", plain), ("spec", spec)):
        sid = engine.open_session(2000, streaming=True)
        first = engine.generate(input_ids=PROMPTS[2], sampling_params={**GREEDY, "max_new_tokens": 16},
                                session_params={"id": sid})
        second = engine.generate(input_ids=PROMPTS[2], sampling_params={**GREEDY, "max_new_tokens": 16},
                                 session_params={"id": sid, "rid": first["meta_info"]["id"]})
        engine.close_session(sid)
        outs[name] = (first["output_ids"], second["output_ids"])
        engine.check_memory()
    assert outs["spec"] == outs["plain"]


def test_sampling_keeps_its_distribution(tiny_llama):
    """Temperature 1 and top_k 2, three tokens: the 8 possible answers of one prompt, drawn 2000
    times with drafts (each request drafts from the answers before it), against the probabilities
    the model gives them (chi-square, 7 degrees of freedom: 24.3 is the 0.1% critical value)."""
    prompt = PROMPTS[3][:12]
    params = {"temperature": 1.0, "top_k": 2, "max_new_tokens": 3, "ignore_eos": True}
    with Engine(tiny_llama, dtype="float32", max_running_requests=8, speculative_algorithm="NGRAM",
                speculative_ngram_min_match_window_size=1) as engine:
        outs = engine.generate(input_ids=[prompt] * 2000, sampling_params=params)
        info = engine.get_server_info()
        assert info["spec_accepted_tokens"] > 100 and info["spec_draft_tokens"] > info["spec_accepted_tokens"]

        def top2(context: list[int]) -> dict[int, float]:
            out = engine.generate(input_ids=context, sampling_params={**GREEDY, "max_new_tokens": 1},
                                  return_logprob=True, top_logprobs_num=2)
            p = {t: math.exp(lp) for lp, t, _ in out["meta_info"]["output_top_logprobs"][0]}
            return {t: v / sum(p.values()) for t, v in p.items()}

        expected: dict[tuple[int, ...], float] = {}
        for a, pa in top2(prompt).items():
            for b, pb in top2(prompt + [a]).items():
                for c, pc in top2(prompt + [a, b]).items():
                    expected[(a, b, c)] = 2000 * pa * pb * pc
        engine.check_memory()
    counts = collections.Counter(tuple(o["output_ids"]) for o in outs)
    assert set(counts) <= set(expected)
    chi2 = sum((counts.get(k, 0) - e) ** 2 / e for k, e in expected.items())
    assert chi2 < 24.3, (chi2, counts, expected)


def test_drafts_come_from_the_request_first_then_the_cache():
    drafter = NgramDrafter(min_n=2, max_n=4, capacity=30, share=True)
    state = RequestDrafts(2, 4)
    own = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert drafter.draft(state, own, [], 3) == [4, 5, 9]  # the longest suffix (1 2 3) seen before
    drafter.add_cached_text([7, 7, 2, 3, 8, 8, 8])
    assert drafter.draft(state, own, [], 3) == [4, 5, 9], "the request's own text comes first"
    other = RequestDrafts(2, 4)
    assert drafter.draft(other, [50, 51, 7, 2, 3], [], 2) == [8, 8], "then the cache's"
    assert drafter.draft(RequestDrafts(2, 4), [60, 61, 62], [], 2) == []
    drafter.add_cached_text(list(range(100, 130)))  # past the capacity: the oldest text leaves
    assert drafter.draft(RequestDrafts(2, 4), [50, 51, 7, 2, 3], [], 2) == []
    assert drafter.draft(RequestDrafts(2, 4), [100, 101, 102], [], 2) == [103, 104]
    split = RequestDrafts(2, 4)  # the text arrives as a prompt and an output growing over calls
    assert drafter.draft(split, [1, 2, 3, 4], [5], 2) == []
    assert drafter.draft(split, [1, 2, 3, 4], [5, 1, 2], 2) == [3, 4]
    assert split.tokens == [1, 2, 3, 4, 5, 1, 2]
    alone = NgramDrafter(min_n=2, max_n=4, capacity=30, share=False)  # no prefix cache: own text only
    alone.add_cached_text([7, 7, 2, 3, 8, 8, 8])
    assert alone.draft(RequestDrafts(2, 4), [50, 51, 7, 2, 3], [], 2) == []


def test_a_request_whose_drafts_fail_pauses():
    state = RequestDrafts(2, 4)
    for _ in range(MIN_DRAFTED // 3 + 1):  # drafts of 3, none accepted: judged once MIN_DRAFTED are in
        assert state.paused == 0
        state.record(3, 0)
    assert state.paused == PAUSE_STEPS
    one_by_one = RequestDrafts(2, 4)
    for _ in range(RECENT_VERIFIES):  # or once RECENT_VERIFIES verifies are in
        one_by_one.record(1, 0)
    assert one_by_one.paused == PAUSE_STEPS
    kept = RequestDrafts(2, 4)
    for _ in range(RECENT_VERIFIES):
        kept.record(3, 1)  # a third accepted: it pays
    assert kept.paused == 0
    drafter = NgramDrafter(2, 4, 100, share=True)
    tokens = [1, 2, 3, 1, 2]
    for _ in range(PAUSE_STEPS):
        assert drafter.draft(state, tokens, [], 4) == []
    assert drafter.draft(state, tokens, [], 4) == [3, 1, 2]


def test_the_flags_are_checked():
    from baby_sgl.server_args import EngineArgs

    with pytest.raises(ValueError, match="NGRAM"):
        EngineArgs(speculative_algorithm="EAGLE")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        EngineArgs(speculative_num_draft_tokens=1)
    with pytest.raises(ValueError, match="match_window"):
        EngineArgs(speculative_ngram_min_match_window_size=5, speculative_ngram_max_match_window_size=3)


def test_min_new_tokens_holds_a_drafted_stop(plain, primed):
    """A stop token that the cached answers (the drafts) hold at step 3 is blocked by
    min_new_tokens 6: verify must sample those rows, not take their argmax."""
    answers = plain.generate(input_ids=PROMPTS, sampling_params={**GREEDY, "max_new_tokens": 32})
    params = [{**GREEDY, "max_new_tokens": 32, "min_new_tokens": 6, "stop_token_ids": [a["output_ids"][3]]}
              for a in answers]
    want = plain.generate(input_ids=PROMPTS, sampling_params=params)
    got = primed.generate(input_ids=PROMPTS, sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert _verified(got) > 0
