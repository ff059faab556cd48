"""What one request may ask of the sampler and the stop checks: stops within a budget checked
before the request is queued (its n samples counted), stops looked for only where a match can
still end, token ids inside the vocabulary, and any accepted sampling value leaving a valid
distribution that the grammar mask still bounds."""

from __future__ import annotations

import re

import httpx
import pytest

from baby_sgl import Engine
from baby_sgl.core.sampling_params import MAX_STOP_CHARS, MAX_STOP_REGEX_PROGRAM, STOP_WINDOW, stop_regex_matcher
from entrypoints.conftest import serve_checked, wait_idle

HOSTILE_STOP_REGEX = [".{1000}" * 36 + "z"] * 32  # 253 bytes each, as the limit allows


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serve_checked(Engine(tiny_llama, dtype="float32", max_total_tokens=4096)) as base:
        yield base


def _error(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


def test_hostile_stop_regex_is_refused_before_it_is_queued(server):
    """The old code accepted these and searched every one over the whole output after every
    token (core/sampling_params.py:SamplingParams._check compiled them with no memory or program
    budget): ~386 ms a step at 1000 tokens, growing with the output."""
    r = httpx.post(server + "/generate", json={"text": "x", "sampling_params": {
        "stop_regex": HOSTILE_STOP_REGEX, "n": 16, "max_new_tokens": 4}})
    assert "stop_regex" in _error(r) and "too large" in _error(r)
    # Small patterns, too many for 16 samples (each compiles to 805 instructions).
    chat = httpx.post(server + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "n": 16, "max_tokens": 4,
        "stop_regex": [f".{{100}}{i}" for i in range(4)]})
    assert "stop_regex" in _error(chat) and "n=16" in _error(chat)
    ok = httpx.post(server + "/generate", json={"text": "x", "sampling_params": {
        "stop_regex": [".{100}0"], "n": 2, "max_new_tokens": 4, "ignore_eos": True}})
    assert [o["meta_info"]["completion_tokens"] for o in ok.json()] == [4, 4]
    assert wait_idle(server)


def test_a_pattern_past_the_program_budget_is_refused_as_it_compiles():
    """A pattern's program past MAX_STOP_REGEX_PROGRAM is refused by RE2's memory limit while it
    compiles, not compiled whole first: \\p{L}{40} (47,851 instructions) compiled for 38 ms under
    the old 1 MiB before the budget refused it, and patterns compile as a body is validated, on the
    event loop. Programs within the budget still compile."""
    with pytest.raises(ValueError, match="too large: its RE2 program outgrows"):
        stop_regex_matcher(r"\p{L}{40}Zunique")
    assert stop_regex_matcher(r"\w{500}").programsize <= MAX_STOP_REGEX_PROGRAM
    assert stop_regex_matcher(".{1000}z").programsize <= MAX_STOP_REGEX_PROGRAM


def test_stop_budget_counts_every_sample(engine):
    """One pattern's program fits one sample and not 16; stop strings are counted in characters.
    (The old code bounded neither by n: core/sampling_params.py:SamplingParams._check.)"""
    pattern = ".{100}z"  # 805 instructions
    fits = MAX_STOP_REGEX_PROGRAM // 805
    engine.generate("x", {"stop_regex": [pattern] * fits, "max_new_tokens": 1})
    with pytest.raises(ValueError, match=r"stop_regex: .* more than 8192 RE2 instructions \(n=2 samples\)"):
        engine.generate("x", {"stop_regex": [pattern] * fits, "n": 2, "max_new_tokens": 1})
    stops = ["s" * 1024] * (MAX_STOP_CHARS // 1024)
    engine.generate("x", {"stop": stops, "max_new_tokens": 1})
    with pytest.raises(ValueError, match=r"stop: 131072 characters of stop strings \(n=2 samples\)"):
        engine.generate("x", {"stop": stops, "n": 2, "max_new_tokens": 1})


@pytest.fixture(scope="module")
def long_engine(tiny_llama_long):
    with Engine(tiny_llama_long, dtype="float32", max_total_tokens=4096) as eng:
        yield eng


@pytest.mark.parametrize("run, found", [(STOP_WINDOW - 30, True), (STOP_WINDOW + 60, False)])
def test_stop_regex_is_searched_where_a_match_can_still_end(long_engine, run, found):
    """A match ending in the new text is found while it is at most STOP_WINDOW characters long;
    one that began further back is not looked for (the old code searched the whole output after
    every token, managers/scheduler_output.py:_check_stop_regex, and found it). ^ still means the
    start of the output, not of the part searched."""
    regex = f"xa{{{run}}}yz"  # the tiny model writes it one byte, one token, at a time
    out = long_engine.generate("p", {"regex": regex, "stop_regex": ["x(?s).*y", "^a"], "max_new_tokens": run + 8})
    assert out["text"] == "x" + "a" * run + ("y" if found else "yz")  # kept whole, as SGLang
    reason = out["meta_info"]["finish_reason"]
    assert (reason["matched"] == "x(?s).*y") is found and reason["type"] == "stop"
    long_engine.check_memory()


def test_stop_strings_are_found_and_trimmed_after_a_long_output(long_engine):
    out = long_engine.generate("p", {"regex": f"a{{{STOP_WINDOW * 2}}}bcd", "stop": ["bc", "zz"],
                                     "max_new_tokens": STOP_WINDOW * 2 + 8})
    assert out["text"] == "a" * STOP_WINDOW * 2 and out["meta_info"]["finish_reason"] == {"type": "stop",
                                                                                          "matched": "bc"}
    long_engine.check_memory()


def test_out_of_vocabulary_stop_token_ids_are_refused(server, engine):
    """The old code accepted them (core/sampling_params.py:check_vocab looked at logit_bias only)."""
    r = httpx.post(server + "/generate", json={"text": "x", "sampling_params": {"stop_token_ids": [3, 512]}})
    assert "stop_token_ids" in _error(r) and "[512]" in _error(r)
    chat = httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                             "stop_token_ids": [10**6]})
    assert "stop_token_ids" in _error(chat)
    with pytest.raises(ValueError, match="stop_token_ids holds token ids outside the vocabulary"):
        engine.generate("x", {"stop_token_ids": [511, 512]})
    assert engine.generate("x", {"stop_token_ids": [511], "max_new_tokens": 2})["meta_info"]["completion_tokens"] <= 2


CONSTRAINT = r"[a-e]{2}-[0-9]{3}"
EXTREMES = [
    {"temperature": t} for t in (1e-6, 1.0, 1e4, 1e38, 1e308, 1.7976931348623157e308)
] + [
    {"temperature": 1e308, "top_p": 1e-9}, {"temperature": 1e308, "top_k": 1}, {"temperature": 1e308, "top_k": 3},
    {"temperature": 1e308, "min_p": 1.0}, {"temperature": 1e-6, "min_p": 0.99, "top_p": 0.5},
    {"temperature": 1e308, "frequency_penalty": 2.0, "presence_penalty": 2.0},
    {"temperature": 1e308, "frequency_penalty": -2.0, "presence_penalty": -2.0},
    {"temperature": 0.0, "repetition_penalty": 5e-324}, {"temperature": 1e308, "repetition_penalty": 5e-324},
    {"temperature": 1.0, "repetition_penalty": 2.0, "frequency_penalty": -2.0, "top_k": 2},
]


def test_extreme_sampling_values_stay_inside_the_constraint(engine):
    """Every accepted temperature, filter and penalty leaves a distribution the grammar bounds.
    The old code divided by temperature 1e308, infinite in float32, after the mask: -inf / inf is
    NaN, and tokens outside the regex were drawn (sampling/sampler.py:Sampler._sample)."""
    params = [{"regex": CONSTRAINT, "max_new_tokens": 12, **p} for p in EXTREMES]
    for seed in range(3):
        outs = engine.generate(["q"] * len(params), [{**p, "seed": seed} for p in params])
        for p, out in zip(params, outs):
            assert re.fullmatch(CONSTRAINT, out["text"]), (p, out["text"])
            assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_extreme_seeded_sampling_is_deterministic(engine):
    params = [{"regex": CONSTRAINT, "max_new_tokens": 12, "seed": 7, **p} for p in EXTREMES]
    first = [o["output_ids"] for o in engine.generate(["q"] * len(params), params)]
    assert first == [o["output_ids"] for o in engine.generate(["q"] * len(params), params)]
    assert [engine.generate("q", p)["output_ids"] for p in params[3:6]] == \
        [engine.generate("q", p)["output_ids"] for p in params[3:6]]
    # A huge temperature is uniform over what the grammar allows: the seeds' outputs differ.
    wide = [engine.generate("q", {**params[4], "seed": s})["text"] for s in range(8)]
    assert len(set(wide)) > 1
